"""Generators put the engine's routed experts into the trajectory when routing replay is on: every position from
the request that ran a forward on it first (a reply's own positions keep the routing they were sampled with),
through single-turn, multi-turn (with an abort continued), the OpenAI proxy's sessions (with a failed turn
rolled back); none when the engine reports none; the rollout worker asks for them under
`learner.routing_replay = "rollout"`; the learner's step counts trajectories trained without one."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from agentrl.actors.rollout import rollout_sampling
from agentrl.chat import chat_tokens
from agentrl.config import Config, load_config
from agentrl.engines.base import SamplingParams
from agentrl.envs import env_factory
from agentrl.generator import RolloutContext, resolve_generator
from agentrl.proxy.openai_params import RequestError
from agentrl.proxy.openai_schema import ChatRequest
from agentrl.proxy.session import ProxySessions
from agentrl.queue.slices import routing_replay_metrics
from agentrl.types import RoutedExperts, Trajectory, mask, n_response, normalize, routed_expert_ids, tokens
from tests.gen_support import HFEngine, Recording

TASK = {"a": 23, "b": 45, "op": "+", "answer": 68}


class MoEEngine(Recording):
    """A real (dense) engine that reports, when asked, what an MoE engine reports: a record of every position
    its request ran a forward on (input + output but the last output token). Each row says which request made
    it and for which position: layer 0 = [request index, position % 251], layer 1 = [position // 251, 0]."""

    def __init__(self, inner, dtype: str = "uint8", silent: tuple[int, ...] = ()):
        super().__init__(inner)
        self.dtype, self.silent = dtype, silent  # requests that come back without a record
        self.fail_next = False  # the next request fails (a lost connection), recorded nowhere
        self.fail_after_abort = False  # set fail_next once a request comes back aborted

    async def generate(self, input_ids, sampling, request_id=None):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("connection reset")
        out = await super().generate(input_ids, sampling, request_id)
        if out.finish_reason == "abort" and self.fail_after_abort:
            self.fail_after_abort, self.fail_next = False, True
        index = len(self.calls) - 1
        if sampling.return_routed_experts and out.output_ids and index not in self.silent:
            n = len(input_ids) + len(out.output_ids) - 1
            ids = np.zeros((n, 2, 2), self.dtype)
            ids[:, 0, 0] = index
            ids[:, 0, 1] = np.arange(n) % 251
            ids[:, 1, 0] = np.arange(n) // 251
            out.routed_experts = RoutedExperts(2, 2, self.dtype, ids.tobytes())
        return out


def owners(traj) -> np.ndarray:
    """The index of the request each position's row came from, after checking the rows are in position order."""
    ids = routed_expert_ids(traj.routed_experts).astype(np.int64)
    assert (ids[:, 0, 1] + 251 * ids[:, 1, 0] == np.arange(len(ids))).all()
    return ids[:, 0, 0]


def ctx_for(engine, tok, replay: bool = True, max_turns: int = 3) -> RolloutContext:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16, return_routed_experts=replay)
    return RolloutContext(engine=engine, tokenizer=tok, make_env=env_factory("calculator", None),
                          env_name="calculator", sampling=sampling, max_turns=max_turns, max_seq_len=256)  # fmt: skip


def scripted(tiny, tok, *texts: str) -> HFEngine:
    eot = chat_tokens(tok).eot_id
    replies = iter([[*tok.encode(t, add_special_tokens=False), eot] for t in texts])
    return HFEngine(tiny, script=lambda _input: next(replies))


def spans(traj) -> tuple[int, int, int, int]:
    """(prompt, first reply, env delta, second reply) lengths of a two-turn trajectory."""
    m = mask(traj)
    first = int(np.argmin(m))
    delta = int((m == 0).sum())
    return len(tokens(traj.prompt_ids)), first, delta, n_response(traj) - first - delta


async def test_single_turn_records_every_position_but_the_last(tiny, tok):
    engine = MoEEngine(scripted(tiny, tok, "<calc>23+45</calc>"), dtype="int16")
    traj = await resolve_generator("single_turn")(ctx_for(engine, tok), TASK, "t", "g")
    total = len(tokens(traj.prompt_ids)) + n_response(traj)
    assert traj.routed_experts.dtype == "int16" and (
        traj.routed_experts.layers,
        traj.routed_experts.topk,
    ) == (2, 2)
    assert owners(traj).tolist() == [0] * (total - 1)
    assert normalize(msgspec.json.decode(msgspec.json.encode(traj), type=type(traj))).routed_experts == (
        traj.routed_experts
    )  # valid on the wire


async def test_multi_turn_keeps_each_position_from_the_request_that_computed_it_first(tiny, tok):
    engine = MoEEngine(scripted(tiny, tok, "<calc>23+45</calc>", "68"))
    traj = await resolve_generator("multi_turn")(ctx_for(engine, tok), TASK, "t", "g")
    prompt, first, delta, second = spans(traj)
    assert traj.status == "completed" and len(engine.calls) == 2
    # turn 1: the prompt and the reply but its last token; its last token, the env delta and turn 2: request 1
    assert owners(traj).tolist() == [0] * (prompt + first - 1) + [1] * (1 + delta + second - 1)
    normalize(traj)


async def test_an_aborted_reply_continued_keeps_the_routing_of_both_pieces(tiny, tok):
    reply = "<calc>23+45</calc>"
    engine = MoEEngine(scripted(tiny, tok, reply, reply, "68"))
    engine.inner.abort_after = 3
    traj = await resolve_generator("multi_turn")(ctx_for(engine, tok), TASK, "t", "g")
    prompt, first, delta, second = spans(traj)
    assert (
        len(engine.calls) == 3 and engine.calls[1] == engine.calls[0] + tokens(traj.response_ids).tolist()[:3]
    )
    expected = [0] * (prompt + 3 - 1) + [1] * (first - 3) + [2] * (delta + second)
    assert owners(traj).tolist() == expected
    normalize(traj)


async def test_no_record_when_off_when_the_engine_has_none_or_a_reply_came_without_one(tiny, tok):
    off = await resolve_generator("multi_turn")(
        ctx_for(MoEEngine(scripted(tiny, tok, "<calc>23+45</calc>", "68")), tok, replay=False), TASK, "t", "g"
    )
    dense = await resolve_generator("multi_turn")(
        ctx_for(scripted(tiny, tok, "<calc>23+45</calc>", "68"), tok), TASK, "t", "g"
    )
    gap = await resolve_generator("multi_turn")(
        ctx_for(MoEEngine(scripted(tiny, tok, "<calc>23+45</calc>", "68"), silent=(1,)), tok), TASK, "t", "g"
    )
    for traj in (off, dense, gap):
        assert traj.status == "completed" and traj.routed_experts is None


def request(*messages: tuple[str, str]) -> ChatRequest:
    return msgspec.convert({"messages": [{"role": r, "content": c} for r, c in messages]}, ChatRequest)


@pytest.mark.parametrize("silent", [(), (1,)], ids=["recorded", "without-record"])
async def test_proxy_sessions_record_their_turns_and_roll_a_failed_one_back(tiny, tok, silent):
    engine = MoEEngine(scripted(tiny, tok, "hello", "<calc>23+45</calc>", "bye"), silent=silent)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=32, return_routed_experts=True)
    proxy = ProxySessions([engine], tok, sampling=sampling, max_seq_len=256)
    first = (await proxy.complete("s", request(("user", "hi"))))[0]
    # the next turn's first piece is aborted after 2 tokens (with its rows, or without a record), its
    # continuation fails: the turn is rolled back, its rows or missing record with it; the retry gets "bye"
    engine.inner.abort_after, engine.fail_after_abort = 2, True
    follow_up = request(("user", "hi"), ("assistant", first.content), ("user", "more"))
    with pytest.raises(RequestError) as err:
        await proxy.complete("s", follow_up)
    assert err.value.status == 502 and len(engine.calls) == 2
    await proxy.complete("s", follow_up)
    [traj] = await proxy.close_session("s", reward=1.0)
    prompt, reply, delta, second = spans(traj)
    assert tok.decode(tokens(traj.response_ids).tolist()[-second:-1]) == "bye"
    assert owners(traj).tolist() == [0] * (prompt + reply - 1) + [2] * (1 + delta + second - 1)
    normalize(traj)


def test_the_rollout_worker_asks_for_routed_experts_when_the_learner_replays_them():
    assert not rollout_sampling(Config(), [2]).return_routed_experts
    on = load_config(overrides={"learner": {"routing_replay": "rollout"}})
    sampling = rollout_sampling(on, [2])
    assert sampling.return_routed_experts and sampling.stop_token_ids == [2]
    assert sampling.max_new_tokens == on.rollout.max_new_tokens


def test_trajectories_trained_without_a_record_are_counted():
    rec = RoutedExperts(1, 1, "uint8", b"\0\0")
    with_rec = normalize(Trajectory(id="a", prompt_ids=[1, 2], response_ids=[3]))
    trajs = [msgspec.structs.replace(with_rec, routed_experts=rec), with_rec, with_rec]
    assert routing_replay_metrics(trajs, "rollout") == {"train/routing_replay_missing": 2.0}
    assert routing_replay_metrics(trajs, "off") == {}
