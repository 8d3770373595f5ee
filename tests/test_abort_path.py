"""The engine abort path end to end on CPU: `serve-engine` on loopback (request ids held as SGLang 0.5.12
holds them), agentrl's SGLang client, the multi_turn generator, and a weight publish in `abort` mode while
episodes are generating, some of them queued (they come back aborted with no tokens)."""

import asyncio
from collections import Counter

import pytest
import torch

from agentrl.actors.broadcast import load_into_engines
from agentrl.engines.base import DiskSource
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.server import EngineServer
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.tiny import make_tiny_model
from agentrl.generator import resolve_generator
from agentrl.types import expand_versions, floats, n_response
from tests.gen_support import Recording, calculator_context

torch.set_num_threads(1)
TASK = {"a": 23, "b": 45, "op": "+", "answer": 68}
EPISODES = 6  # on an engine that runs 2 requests at a time: 4 wait queued when the publish aborts them


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("abort")
    return make_tiny_model(root / "a", seed=1), make_tiny_model(root / "b", seed=2)


class Outcomes(Recording):
    """Records each request's id and how it came back."""

    def __init__(self, inner):
        super().__init__(inner)
        self.outcomes: list[tuple[str, str, int]] = []

    async def generate(self, input_ids, sampling, request_id=None):
        out = await super().generate(input_ids, sampling, request_id)
        self.outcomes.append((request_id, out.finish_reason, len(out.output_ids)))
        return out


async def test_publish_in_abort_mode_continues_queued_and_running_episodes(models):
    engine = EmbeddedEngine(str(models[0]), max_batch_size=2, max_seq_len=512)
    server = EngineServer(engine)
    client = SGLangEngine(await server.start())
    recorder = Outcomes(client)
    ctx = calculator_context(recorder, models[0], max_new_tokens=200, max_seq_len=512)
    generate = resolve_generator("multi_turn")
    try:
        episodes = [asyncio.create_task(generate(ctx, TASK, f"t0-s{k}", "t0")) for k in range(EPISODES)]
        while not (engine.n_waiting() == EPISODES - 2 and min(engine.running_tokens()) >= 2):
            await asyncio.sleep(0.002)
        await load_into_engines([client], 1, DiskSource(str(models[1])), "abort")
        trajs = await asyncio.gather(*episodes)
    finally:
        await client.close()
        await server.stop(close_engine=True)
    ids = [rid for rid, _, _ in recorder.outcomes]
    assert len(set(ids)) == len(ids), Counter(ids).most_common(2)
    aborted = [(rid, n) for rid, reason, n in recorder.outcomes if reason == "abort"]
    assert any(n == 0 for _, n in aborted) and any(n > 0 for _, n in aborted), aborted
    straddled = 0
    for traj in trajs:
        n = n_response(traj)
        assert traj.status in ("completed", "truncated") and "abort" not in traj.metadata["finish_reasons"]
        assert n > 0 and len(floats(traj.logprobs)) == n and sum(c for _, c in traj.versions) == n
        versions = expand_versions(traj.versions, n)
        assert list(versions) == sorted(versions) and set(versions) <= {0, 1}
        straddled += set(versions) == {0, 1}
    assert straddled >= 2  # the two running replies continued on the new weights
