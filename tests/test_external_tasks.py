"""The `external` generator's task server on loopback (in-process, real HTTP): claiming, env steps, rewards,
bad input naming its field, the bearer token."""

from __future__ import annotations

import asyncio

import aiohttp

from agentrl.envs.calculator import CalculatorEnv
from agentrl.generators.external import Episode, TaskBoard


async def parked(board: TaskBoard, tid: str) -> Episode:
    env = CalculatorEnv()
    task = env.sample_tasks(0, 1)[0]
    opening = [{"role": m.role, "content": m.content} for m in await env.reset(task)]
    episode = Episode(tid, "g", task, env, opening, "http://proxy/v1/sessions/" + tid, 3)
    await board.park(episode)
    return episode


async def test_claim_step_and_reward():
    board = TaskBoard()
    url = await board.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/tasks/next") as resp:
                assert resp.status == 204
            first = await parked(board, "t0-s0")
            second = await parked(board, "t0-s1")
            async with http.get(f"{url}/v1/tasks/next", params={"wait_s": "1"}) as resp:
                task = await resp.json()
            assert task["task_id"] == "t0-s0" and task["messages"][-1]["role"] == "user"
            assert task["base_url"].endswith("/v1/sessions/t0-s0") and task["max_turns"] == 3
            expr = f"{first.task['a']}+{first.task['b']}"
            async with http.post(
                f"{url}/v1/tasks/t0-s0/step", json={"action": f"<calc>{expr}</calc>"}
            ) as resp:
                step = await resp.json()
            assert not step["done"] and step["reward"] == 0.2 and "<result>" in step["messages"][0]["content"]
            answer = str(first.task["answer"])
            async with http.post(f"{url}/v1/tasks/t0-s0/step", json={"action": answer}) as resp:
                assert (await resp.json())["done"]
            assert first.done.result() == (1.0, {})
            async with http.post(f"{url}/v1/tasks/t0-s1/reward", json={"reward": 0.5}) as resp:
                assert resp.status == 404  # parked, not yet claimed
            await board.claim(0)
            async with http.post(
                f"{url}/v1/tasks/t0-s1/reward", json={"reward": 0.5, "metadata": {"k": 1}}
            ) as r:
                assert r.status == 200
            assert second.done.result() == (0.5, {"k": 1})
            async with http.post(f"{url}/v1/tasks/t0-s1/reward", json={"reward": 1}) as resp:
                assert resp.status == 409
    finally:
        await board.stop()


async def test_bad_input_names_the_field_and_the_token_is_required():
    board = TaskBoard(token="s3cret")
    url = await board.start()
    auth = {"Authorization": "Bearer s3cret"}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/tasks/next") as resp:
                assert resp.status == 401
            async with http.get(f"{url}/health") as resp:
                assert resp.status == 200
            async with http.get(f"{url}/v1/tasks/next", params={"wait_s": "soon"}, headers=auth) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "wait_s"
            async with http.get(f"{url}/v1/tasks/next", params={"wait_s": "999"}, headers=auth) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "wait_s"
            await parked(board, "t1-s0")
            await board.claim(0)
            cases = [
                ("step", {"act": "x"}, "act"),
                ("step", {}, "action"),
                ("reward", {"reward": "high"}, "reward"),
            ]
            for route, body, field in cases:
                async with http.post(f"{url}/v1/tasks/t1-s0/{route}", json=body, headers=auth) as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["param"] == field, body
            async with http.post(f"{url}/v1/tasks/t1-s0/step", data=b"{", headers=auth) as resp:
                assert resp.status == 400
            async with http.post(f"{url}/v1/tasks/nope/step", json={"action": "1"}, headers=auth) as resp:
                assert resp.status == 404 and (await resp.json())["error"]["param"] == "task_id"
    finally:
        await board.stop()


async def test_a_waiting_agent_gets_the_task_parked_while_it_waits():
    board = TaskBoard()
    waiter = asyncio.create_task(board.claim(5))
    await asyncio.sleep(0.05)
    episode = await parked(board, "t2-s0")
    assert await waiter is episode and episode.claimed.is_set()
