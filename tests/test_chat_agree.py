"""One chat-to-tokens (`agentrl.chat`) for the three paths that turn a conversation into a trajectory: the
multi-turn generator (an env driving a scripted engine), the OpenAI proxy (an agent posting the conversation
turn by turn) and the queue's chat form (the whole conversation posted to `/v1/trajectories`). The same
conversation gives the same prompt, response and loss mask, byte for byte: assistant tokens and their
end-of-turn token are trained, the template glue after it (`\\n`) is not."""

from __future__ import annotations

import aiohttp

from agentrl.chat import chat_tokens
from agentrl.config.serving import QueueSection
from agentrl.engines.base import SamplingParams
from agentrl.envs import env_factory, make_env
from agentrl.generator import RolloutContext, resolve_generator
from agentrl.proxy.server import OpenAIProxy
from agentrl.queue import ReplayQueue
from agentrl.queue.server import BackgroundServer
from agentrl.tokenizer import load_tokenizer
from agentrl.types import Trajectory, mask, tokens
from tests.gen_support import HFEngine

TASK = {"a": 23, "b": 45, "op": "+", "answer": 68}
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Count to three."},
    {"role": "assistant", "content": "one"},
    {"role": "user", "content": "go on"},
    {"role": "assistant", "content": "two three"},
    {"role": "user", "content": "and back?"},
    {"role": "tool", "content": "<result>ok</result>"},
    {"role": "assistant", "content": "three two one"},
]


def scripted(tiny, tok, conversation: list[dict]) -> HFEngine:
    """An engine that replies with the conversation's assistant turns (content + end-of-turn)."""
    eot = chat_tokens(tok).eot_id
    texts = [m["content"] for m in conversation if m["role"] == "assistant"]
    replies = iter([[*tok.encode(t, add_special_tokens=False), eot] for t in texts])
    return HFEngine(tiny, script=lambda _input: next(replies))


def layout(traj: Trajectory) -> tuple[list[int], list[int], list[int]]:
    return tokens(traj.prompt_ids).tolist(), tokens(traj.response_ids).tolist(), mask(traj).tolist()


async def via_proxy(tiny, tok, conversation: list[dict]) -> Trajectory:
    sunk: list[Trajectory] = []

    async def sink(trajs: list[Trajectory]) -> None:
        sunk.extend(trajs)

    proxy = OpenAIProxy(
        [scripted(tiny, tok, conversation)], tok, sink=sink, sampling=SamplingParams(max_new_tokens=16)
    )
    url = await proxy.start() + "/v1/sessions/s"
    try:
        async with aiohttp.ClientSession() as http:
            for k, message in enumerate(conversation):
                if message["role"] != "assistant":
                    continue
                async with http.post(url + "/chat/completions", json={"messages": conversation[:k]}) as resp:
                    body = await resp.json()
                assert body["choices"][0]["message"]["content"] == message["content"], body
            async with http.post(url + "/reward", json={"reward": 1.0}) as resp:
                assert resp.status == 200
    finally:
        await proxy.stop()
    assert len(sunk) == 1  # one segment: the history was never rewritten
    return sunk[0]


def via_queue(tiny, tmp_path, conversation: list[dict]) -> Trajectory:
    from tests.test_queue_http import post_json

    cfg = QueueSection()
    server = BackgroundServer(lambda: ReplayQueue(cfg, tmp_path), cfg, tokenizer_path=str(tiny))
    try:
        status, _, body = post_json(
            server.url, {"id": "c", "messages": conversation, "reward": 1.0}, token=None
        )
        assert status == 202, body
        return server.call(server.queue.sample_batch, 1).trajectories[0]
    finally:
        server.stop()


async def test_generator_proxy_and_queue_chat_form_agree(tiny, tmp_path):
    tok = load_tokenizer(tiny)
    demo = [{"role": m.role, "content": m.content} for m in make_env("calculator").demonstration(TASK)]
    ctx = RolloutContext(engine=scripted(tiny, tok, demo), tokenizer=tok, make_env=env_factory("calculator"),
                         env_name="calculator", sampling=SamplingParams(max_new_tokens=16), max_turns=3,
                         max_seq_len=256)  # fmt: skip
    rollout = await resolve_generator("multi_turn")(ctx, TASK, "t", "g")
    assert rollout.status == "completed"
    expected = layout(rollout)
    assert layout(await via_proxy(tiny, tok, demo)) == expected
    assert layout(via_queue(tiny, tmp_path / "q", demo)) == expected


async def test_proxy_and_queue_chat_form_agree_and_never_train_template_glue(tiny, tmp_path):
    tok = load_tokenizer(tiny)
    proxied = layout(await via_proxy(tiny, tok, CHAT))
    assert layout(via_queue(tiny, tmp_path / "q", CHAT)) == proxied
    eot = chat_tokens(tok).eot_id
    _, response, loss_mask = proxied
    replies_end = [i for i, t in enumerate(response) if t == eot and loss_mask[i]]
    assert len(replies_end) == 3 and replies_end[-1] == len(response) - 1
    assert all(loss_mask[i + 1] == 0 for i in replies_end[:-1])  # the `\n` after <|im_end|> is glue
    trained = tok.decode([t for t, m in zip(response, loss_mask, strict=True) if m], skip_special_tokens=True)
    assert trained == "onetwo threethree two one"
