"""A Ctrl-C is one cancellation of the main task (asyncio.run); it must not be lost. CI once sent SIGINT to a
fast run (a step every ~45 ms) that trained on for 90 s: Python 3.11's asyncio.wait_for returns the result and
drops the cancellation when the awaited call finishes at that moment, and every publish went through one."""

import asyncio
import sys

import pytest

from agentrl.actors.common import within
from agentrl.runner.trainer import _stop_if_cancelled


async def _cancel_as_it_finishes(wait) -> str:
    """Start `wait(future)` in a task, then finish the future and cancel the task before it resumes."""
    done = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(wait(done))
    await asyncio.sleep(0)  # the task now waits on `done`
    done.set_result("published")
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def test_a_cancellation_that_meets_the_result_is_kept():
    assert await _cancel_as_it_finishes(lambda f: within(f, 5.0)) == "cancelled"


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the 3.11 wait_for race (3.12 rebuilt wait_for)")
async def test_python_3_11_wait_for_drops_it():  # why `within` exists: this is what publishes did before
    assert await _cancel_as_it_finishes(lambda f: asyncio.wait_for(f, 5.0)) == "published"


async def test_within_still_times_out():
    with pytest.raises(TimeoutError):
        await within(asyncio.sleep(5), 0.01)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is 3.11+")
async def test_the_loop_stops_on_a_cancellation_something_swallowed():
    steps = []

    async def loop():
        while len(steps) < 100:
            _stop_if_cancelled()
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass  # what a library that drops a cancellation amounts to
            steps.append(1)

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.03)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(steps) < 100
