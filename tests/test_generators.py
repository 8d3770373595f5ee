"""single_turn and multi_turn generators against real engines: token-in/token-out, loss masks exactly over
env tokens, logprobs, per-token versions, statuses, truncation, aborts, and the demonstration tokenization.

The embedded engine runs a tiny model made here; a copy briefly fine-tuned on calculator demonstrations
gives real multi-turn episodes. HFEngine (tests/gen_support.py) runs the same model through transformers
and can force a reply's tokens, to drive an env down a chosen path with the model's own logprobs."""

import asyncio

import msgspec
import numpy as np
import pytest
from safetensors.torch import load_file

from agentrl.chat import chat_tokens, demonstration_tokens
from agentrl.engines.base import SamplingParams, TensorSource
from agentrl.envs import env_factory, make_env
from agentrl.generator import RolloutContext, resolve_generator
from agentrl.tokenizer import load_tokenizer
from agentrl.types import Message, expand_versions, floats, mask, n_response, normalize, tokens
from tests.gen_support import (
    HFEngine,
    Recording,
    embedded_engine,
    real_model_logprob,
    sft_on_demonstrations,
)

TASK = {"a": 23, "b": 45, "op": "+", "answer": 68}


@pytest.fixture(scope="module")
def tuned(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned")
    losses = sft_on_demonstrations(tiny, out, "calculator", steps=80)
    assert losses["last_loss"] < losses["first_loss"] / 2
    return out


def context(engine, tok, env="calculator", max_turns=3, max_seq_len=256, env_kwargs=None, **sampling):
    params = SamplingParams(**{"temperature": 1.0, "max_new_tokens": 16, "seed": 0, **sampling})
    return RolloutContext(engine=engine, tokenizer=tok, make_env=env_factory(env, env_kwargs), env_name=env,
                          sampling=params, max_turns=max_turns, max_seq_len=max_seq_len)  # fmt: skip


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def runs(values):
    """[(value, length)] runs of a sequence."""
    out = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return [tuple(r) for r in out]


async def replay(tok, env_name, task, traj, env_kwargs=None):
    """Re-play a trajectory's model replies through a fresh env and check, token by token, that every env
    span is exactly the template delta of that env's feedback. Returns the conversation."""
    chat = chat_tokens(tok)
    env = make_env(env_name, env_kwargs)
    conversation = list(await env.reset(task))
    assert tokens(traj.prompt_ids).tolist() == chat.prompt_ids(conversation)
    response, m = tokens(traj.response_ids).tolist(), mask(traj).tolist()
    spans, pos = [], 0
    for value, length in runs(m):
        spans.append((value, response[pos : pos + length]))
        pos += length
    assert [v for v, _ in spans] == [1, 0] * (len(spans) // 2) + [1] * (len(spans) % 2)
    rewards = []
    for k in range(0, len(spans), 2):
        reply = spans[k][1]
        result = await env.step(chat.decode(reply))
        rewards.append(result.reward)
        conversation.append(Message("assistant", chat.decode(reply)))
        if k + 1 < len(spans):
            assert not result.done
            assert spans[k + 1][1] == chat.delta_ids(result.messages, reply)
            conversation += result.messages
    assert traj.turn_rewards == pytest.approx(rewards)
    return conversation


def check_arrays(traj):
    n = n_response(traj)
    assert len(floats(traj.logprobs)) == n and sum(c for _, c in traj.versions) == n
    lp, m = floats(traj.logprobs), mask(traj)
    assert (lp[m == 0] == 0.0).all() and (lp[m == 1] < 0).all()
    normalize(msgspec.json.decode(msgspec.json.encode(traj), type=type(traj)))  # valid on the wire


async def test_single_turn_embedded(tiny, tok):
    engine = Recording(embedded_engine(tiny))
    gen = resolve_generator("single_turn")
    ctx = context(engine, tok, env="arithmetic", max_new_tokens=6)
    trajs = await asyncio.gather(
        *[gen(ctx, t, f"t{i}", "g") for i, t in enumerate(make_env("arithmetic").sample_tasks(0, 8))]
    )
    for traj, call in zip(trajs, engine.calls, strict=True):
        prompt, response = tokens(traj.prompt_ids).tolist(), tokens(traj.response_ids).tolist()
        assert call == prompt
        assert traj.loss_mask is None and traj.versions == [(0, len(response))]
        check_arrays(traj)
        closed = response[-1] in chat_tokens(tok).stop_ids
        assert traj.status == ("completed" if closed else "truncated") and len(response) <= 6
        env = make_env("arithmetic")
        task = make_env("arithmetic").sample_tasks(0, 8)[int(traj.id[1:])]
        await env.reset(task)
        assert traj.reward == (await env.step(chat_tokens(tok).decode(response))).reward
    lp = floats(trajs[0].logprobs)
    first = tokens(trajs[0].response_ids).tolist()
    assert lp[0] == pytest.approx(real_model_logprob(tiny, engine.calls[0], first[0]), abs=1e-4)
    assert lp[1] == pytest.approx(real_model_logprob(tiny, engine.calls[0] + first[:1], first[1]), abs=1e-4)
    await engine.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_multi_turn_token_in_token_out(tuned, tok, temperature):
    engine = Recording(embedded_engine(tuned))
    gen = resolve_generator("multi_turn")
    ctx = context(engine, tok, temperature=temperature, seed=None)
    tasks = make_env("calculator").sample_tasks(3, 12)
    trajs = await asyncio.gather(*[gen(ctx, t, f"t{i}", "g") for i, t in enumerate(tasks)])
    if temperature == 0.0:
        assert min(t.metadata["turns"] for t in trajs) >= 2  # the tuned model really calls the tool
    chat = chat_tokens(tok)
    for traj, task in zip(trajs, tasks, strict=True):
        check_arrays(traj)
        conversation = await replay(tok, "calculator", task, traj)
        prompt, response = tokens(traj.prompt_ids).tolist(), tokens(traj.response_ids).tolist()
        mine = [c for c in engine.calls if c[: len(prompt)] == prompt]
        # each turn's input is exactly the previous input + output + env delta
        for k, call in enumerate(mine):
            assert call == (prompt + response)[: len(call)]
            assert k == 0 or mask(traj)[len(call) - len(prompt) - 1] == 0
        assert len(mine) == traj.metadata["turns"]
        assert traj.reward == pytest.approx(sum(traj.turn_rewards))
        if temperature == 0.0:
            text = tok.decode(prompt + response, skip_special_tokens=False)
            rendered = chat.render([{"role": m.role, "content": m.content} for m in conversation])
            closed = response[-1] == chat.eot_id
            assert rendered == text + (chat.after_eot if closed else chat.suffix)
    await engine.close()


async def test_scripted_calculator_episode_matches_demonstration(tiny, tok):
    chat = chat_tokens(tok)
    replies = iter([[*ids(tok, "<calc>23+45</calc>"), chat.eot_id], [*ids(tok, "68"), chat.eot_id]])
    engine = HFEngine(tiny, version=4, script=lambda _input: next(replies))
    traj = await resolve_generator("multi_turn")(context(engine, tok), TASK, "t", "g")
    assert (traj.status, traj.reward, traj.turn_rewards) == (
        "completed",
        pytest.approx(1.0),
        [pytest.approx(0.2), pytest.approx(0.8)],
    )
    response = tokens(traj.response_ids).tolist()
    assert tok.decode(response, skip_special_tokens=False) == (
        "<calc>23+45</calc><|im_end|>\n<|im_start|>tool\n<result>68</result><|im_end|>\n<|im_start|>assistant\n68<|im_end|>"
    )
    prompt, demo_response, demo_mask = demonstration_tokens(tok, make_env("calculator").demonstration(TASK))
    assert tokens(traj.prompt_ids).tolist() == prompt
    assert response == demo_response and mask(traj).tolist() == demo_mask  # SFT data = RL token layout
    n1 = len(ids(tok, "<calc>23+45</calc>")) + 1
    lp = floats(traj.logprobs)
    full = prompt + response
    for i in (0, n1 - 1, len(response) - 1):  # model tokens: the model's own logprob of the forced token
        assert lp[i] == pytest.approx(
            real_model_logprob(tiny, full[: len(prompt) + i], response[i]), abs=1e-4
        )
    assert traj.versions == [(4, len(response))]


async def test_versions_follow_weight_update_mid_episode(tuned, tok):
    state = load_file(str(tuned / "model.safetensors"))

    async def update(engine):
        await engine.update_weights(7, TensorSource(state))

    chat = chat_tokens(tok)
    replies = iter([[*ids(tok, "<calc>23+45</calc>"), chat.eot_id], [*ids(tok, "68"), chat.eot_id]])
    engine = Recording(HFEngine(tuned, script=lambda _input: next(replies)), before_call={1: update})
    traj = await resolve_generator("multi_turn")(context(engine, tok), TASK, "t", "g")
    m = mask(traj)
    first_turn = int(np.argmin(m))  # model tokens of turn 1, then env tokens
    env_len = int((m == 0).sum())
    assert traj.versions == [(0, first_turn + env_len), (7, n_response(traj) - first_turn - env_len)]
    versions = expand_versions(traj.versions, n_response(traj))
    assert (versions[m == 0] == 0).all()  # env tokens carry the version of the model token before them


async def test_abort_is_continued_from_partial_output(tiny, tok):
    chat = chat_tokens(tok)
    reply = [*ids(tok, "<calc>23+45</calc>"), chat.eot_id]
    answer = [*ids(tok, "68"), chat.eot_id]
    script = iter([reply, reply, answer])
    engine = HFEngine(tiny, script=lambda _input: next(script))
    engine.abort_after = 3
    traj = await resolve_generator("multi_turn")(context(engine, tok), TASK, "t", "g")
    assert traj.status == "completed" and traj.reward == pytest.approx(1.0)
    assert tokens(traj.response_ids).tolist()[: len(reply)] == reply
    assert len(engine.calls) == 3 and engine.calls[1] == engine.calls[0] + reply[:3]
    assert traj.metadata["finish_reasons"] == ["stop", "stop"]

    engine = HFEngine(tiny, script=lambda _input: reply)
    engine.abort_after = 3
    ctx = context(engine, tok)
    ctx.abort_retries = 0
    traj = await resolve_generator("multi_turn")(ctx, TASK, "t", "g")
    assert traj.status == "aborted" and n_response(traj) == 3 and traj.turn_rewards == []


async def test_an_abort_before_any_token_is_re_sent_under_a_new_id_and_leaves_no_trace(tiny, tok):
    """A queued request aborted by a weight update comes back with no tokens: the generator re-sends it as the
    next piece of the same turn (a new id: SGLang keeps the old one registered), and the trajectory is the one
    an undisturbed episode gives."""
    chat = chat_tokens(tok)
    reply = [*ids(tok, "<calc>23+45</calc>"), chat.eot_id]
    answer = [*ids(tok, "68"), chat.eot_id]

    async def episode(abort_first, request_prefix):
        script = iter([reply, answer] if not abort_first else [reply, reply, answer])
        engine = Recording(HFEngine(tiny, script=lambda _input: next(script)))
        engine.inner.abort_after = 0 if abort_first else None
        ctx = context(engine, tok)
        ctx.request_prefix = request_prefix
        return await resolve_generator("multi_turn")(ctx, TASK, "t7-s1", "t7"), engine.request_ids

    plain, plain_ids = await episode(False, "")
    traj, request_ids = await episode(True, "t7-s1.a2")
    assert plain_ids == ["t7-s1.t0.0", "t7-s1.t1.0"]
    assert request_ids == ["t7-s1.a2.t0.0", "t7-s1.a2.t0.1", "t7-s1.a2.t1.0"] and traj.id == "t7-s1"
    assert traj.status == plain.status == "completed" and traj.metadata == plain.metadata
    for field in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions", "turn_rewards"):
        assert getattr(traj, field) == getattr(plain, field), field


async def test_truncation_statuses(tiny, tok):
    chat = chat_tokens(tok)
    guess = [*ids(tok, "8"), chat.eot_id]
    gen = resolve_generator("multi_turn")
    # max_turns reached before the env is done
    ctx = context(HFEngine(tiny, script=lambda _i: guess), tok, env="guess_number", max_turns=2)
    traj = await gen(ctx, {"secret": 3}, "t", "g")
    assert traj.status == "truncated" and traj.metadata["turns"] == 2 and traj.reward == 0.0
    await replay(tok, "guess_number", {"secret": 3}, traj)
    # the env finishes within max_turns
    ctx = context(HFEngine(tiny, script=lambda _i: guess), tok, env="guess_number", max_turns=6)
    traj = await gen(ctx, {"secret": 8}, "t", "g")
    assert traj.status == "completed" and traj.reward == 1.0 and traj.metadata["turns"] == 1
    # max_seq_len: stop before the next turn would not fit; never exceed it
    ctx = context(
        HFEngine(tiny, script=lambda _i: guess), tok, env="guess_number", max_turns=6, max_seq_len=40
    )
    traj = await gen(ctx, {"secret": 3}, "t", "g")
    total = n_response(traj) + len(tokens(traj.prompt_ids))
    assert traj.status == "truncated" and total < 40 and traj.metadata["turns"] < 5
    # a reply cut by max_new_tokens ends the episode as truncated (the env still scores it)
    long = ids(tok, "<calc>23+45+1+1+1+1+1</calc>")
    ctx = context(HFEngine(tiny, script=lambda _i: long), tok, max_new_tokens=5)
    traj = await gen(ctx, TASK, "t", "g")
    assert (
        traj.status == "truncated" and n_response(traj) == 5 and traj.metadata["finish_reasons"] == ["length"]
    )


async def test_episode_reward_override_and_raw_prompts(tiny, tok):
    chat = chat_tokens(tok)
    engine = HFEngine(tiny, script=lambda _i: [*ids(tok, "\\boxed{3}"), chat.eot_id])
    ctx = context(engine, tok, env="math")
    ctx.make_env = env_factory("math", reward="tests.test_generators:always_07")
    task = {"prompt": "1+2=", "answer": "3", "apply_chat_template": False}
    traj = await resolve_generator("single_turn")(ctx, task, "t", "g")
    assert tokens(traj.prompt_ids).tolist() == tok.encode("1+2=", add_special_tokens=True)
    assert traj.turn_rewards == [1.0] and traj.reward == pytest.approx(0.7)


def always_07(response, task):
    return 0.7


def test_generator_names_resolve():
    import agentrl.generators.multi_turn
    import agentrl.generators.proxy_agent
    import agentrl.generators.single_turn

    assert resolve_generator("single_turn") is agentrl.generators.single_turn.generate
    assert resolve_generator("multi_turn") is agentrl.generators.multi_turn.generate
    assert resolve_generator("openai_proxy") is agentrl.generators.proxy_agent.generate
    assert resolve_generator("tests.test_generators:always_07") is always_07


LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% if messages[0]['role'] != 'system' %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>' }}{% endif %}"
    "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def test_deltas_with_a_llama3_style_template(tiny):
    tok = load_tokenizer(tiny)
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ]
        }
    )
    tok.chat_template = LLAMA3_TEMPLATE
    chat = chat_tokens(tok)
    assert chat.eot_id == tok.convert_tokens_to_ids("<|eot_id|>") and chat.after_eot == ""
    assert chat.eot_id in chat.stop_ids and tok.eos_token_id in chat.stop_ids
    demo = make_env("calculator").demonstration(TASK)
    prompt, response, loss_mask = demonstration_tokens(tok, demo)
    rendered = chat.render([{"role": m.role, "content": m.content} for m in demo])
    assert (
        tok.decode(prompt + response, skip_special_tokens=False) == rendered
    )  # default system prompt kept once
    env_part = [t for t, m in zip(response, loss_mask, strict=True) if m == 0]
    assert tok.decode(env_part, skip_special_tokens=False) == (
        "<|start_header_id|>tool<|end_header_id|>\n\n<result>68</result><|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # a reply that ended on a different stop token gets the template's whole end-of-turn suffix (masked)
    reply = [*tok.encode("7", add_special_tokens=False), tok.eos_token_id]
    delta = chat.delta_ids([Message("user", "Lower.")], reply)
    assert tok.decode(delta, skip_special_tokens=False).startswith("<|eot_id|><|start_header_id|>user")


def test_fast_encode_matches_the_tokenizer_and_caches_are_copies(tok):
    chat = chat_tokens(tok)
    texts = [
        "<calc>23+45</calc>",
        "\n<|im_start|>tool\n<result>68</result><|im_end|>\n",
        "héllo wörld ∑ 🙂",
        " a  b\t\n",
        "",
    ]
    for text in texts:
        assert chat.encode(text) == tok.encode(text, add_special_tokens=False)
    opening = [Message("user", "What is 1+2?")]
    first = chat.prompt_ids(opening)
    first.append(-1)  # callers may mutate what they get: the cache must not change
    assert chat.prompt_ids(opening) == first[:-1]
    delta = chat.delta_ids([Message("user", "Lower.")], [chat.eot_id])
    delta.clear()
    assert chat.delta_ids([Message("user", "Lower.")], [chat.eot_id]) != []
