"""guess_number's options for learnability: `feedback = "range"` states the range the secret is
still in (`"hint"` adds its midpoint, `"try"` gives the verdict and that midpoint alone), `turn_cost` sets how
much each extra turn costs a win; both reach the demonstration too, and bad values are refused naming the key."""

import itertools
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from agentrl.envs import make_env
from agentrl.errors import EnvError


async def play(env, secret: int, replies: list[str]):
    await env.reset({"secret": secret})
    results = []
    for reply in replies:
        results.append(await env.step(reply))
        if results[-1].done:
            break
    return results


async def test_range_feedback_narrows_and_never_widens():
    env = make_env("guess_number", {"feedback": "range", "max_guesses": 6})
    results = await play(env, 11, ["8", "12", "3", "banana", "10", "11"])
    assert [r.messages[0].content for r in results[:-1]] == [
        "Higher: 9 to 16.",
        "Lower: 9 to 11.",
        "Higher: 9 to 11.",  # a guess below the known range tells nothing new
        "Reply with a number from 1 to 16.",
        "Higher: 11 to 11.",
    ]
    assert results[-1].done and results[-1].reward == pytest.approx(1 - 5 / 6)
    # A new episode starts from the whole range again.
    assert (await play(env, 2, ["8"]))[0].messages[0].content == "Lower: 1 to 7."


async def test_turn_cost_keeps_every_win_above_a_loss():
    env = make_env("guess_number", {"turn_cost": 0.1})
    assert [(await play(env, 5, ["5"]))[-1].reward] == [1.0]
    last = await play(env, 5, ["1", "2", "3", "4", "5"])
    assert last[-1].done and last[-1].reward == pytest.approx(0.6)
    lost = await play(env, 5, ["1", "2", "3", "4", "6"])
    assert lost[-1].done and lost[-1].reward == 0.0
    # The default is unchanged: 1/max_guesses per extra turn.
    assert (await play(make_env("guess_number"), 5, ["1", "5"]))[-1].reward == pytest.approx(0.8)


@pytest.mark.parametrize("kwargs", [{"feedback": "range"}, {"feedback": "range", "low": 1, "high": 8}])
async def test_range_demonstration_replays_to_the_top_reward(kwargs):
    env = make_env("guess_number", {**kwargs, "turn_cost": 0.1})
    for secret in range(env.low, env.high + 1):
        demo = env.demonstration({"secret": secret})
        replies = [m.content for m in demo if m.role == "assistant"]
        results = await play(make_env("guess_number", {**kwargs, "turn_cost": 0.1}), secret, replies)
        assert [m for r in results for m in r.messages] == [m for m in demo[1:] if m.role == "user"]
        assert results[-1].reward == pytest.approx(1 - 0.1 * (len(replies) - 1))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"feedback": "interval"}, "env.kwargs.feedback"),
        ({"turn_cost": 0.25}, "env.kwargs.turn_cost"),  # a win on turn 5 would score 0, like a loss
        ({"turn_cost": -0.1}, "env.kwargs.turn_cost"),
        ({"demo_bisect": 1.5}, "env.kwargs.demo_bisect"),
    ],
)
def test_bad_options_named(kwargs, key):
    with pytest.raises(EnvError, match=key.replace(".", r"\.")):
        make_env("guess_number", kwargs)


def test_example_config_fits_the_env(tok):
    """examples/guess_number.toml: every demonstration fits in rollout.max_turns, and every guess (plus the
    end-of-turn token) fits in rollout.max_new_tokens, so the warm-up teaches what a rollout can produce."""
    from agentrl.config import load_config

    cfg = load_config(Path(__file__).parent.parent / "examples" / "guess_number.toml")
    env = make_env(cfg.env.name, cfg.env.kwargs)
    assert cfg.rollout.max_turns >= env.max_guesses
    for secret in range(env.low, env.high + 1):
        demo = env.demonstration({"secret": secret})
        assert sum(m.role == "assistant" for m in demo) <= cfg.rollout.max_turns
    longest = max(len(tok.encode(str(n), add_special_tokens=False)) for n in range(env.low, env.high + 1))
    assert longest + 1 <= cfg.rollout.max_new_tokens


async def test_hint_feedback_names_the_binary_search_guess():
    env = make_env("guess_number", {"feedback": "hint", "max_guesses": 6})
    opening = await env.reset({"secret": 11})
    assert opening[0].content == "Guess my number from 1 to 16. Try 8."
    results = await play(env, 11, ["8", "12", "banana", "20", "10"])
    assert [r.messages[0].content for r in results] == [
        "Higher: 9 to 16. Try 12.",
        "Lower: 9 to 11. Try 10.",
        "Reply with a number from 1 to 16. Try 10.",  # the hint still names the range's midpoint
        "Reply with a number from 1 to 16. Try 10.",
        "Higher: 11 to 11. Try 11.",
    ]
    # Following every hint is the binary search: it finds each secret, as the bisect demonstration does.
    for secret in range(1, 17):
        await env.reset({"secret": secret})
        hint = "8"
        for _ in range(5):
            result = await env.step(hint)
            if result.done:
                break
            hint = result.messages[0].content.split("Try ")[1].rstrip(".")
        assert result.done and result.reward > 0, secret


async def test_try_feedback_holds_only_the_number_to_copy():
    """`feedback = "try"`: the verdict and the hint alone, so the only number in each feedback is the next
    binary-search guess (no range bounds to copy on a later turn); the demonstration is that conversation."""
    env = make_env("guess_number", {"feedback": "try", "max_guesses": 6})
    opening = await env.reset({"secret": 11})
    assert opening[0].content == "Guess my number from 1 to 16. Try 8."
    results = await play(env, 11, ["8", "12", "banana", "3", "10"])
    assert [r.messages[0].content for r in results] == [
        "Higher. Try 12.",
        "Lower. Try 10.",  # the range is now 9 to 11, but only its midpoint is said
        "Reply with a number from 1 to 16. Try 10.",
        "Higher. Try 10.",  # a guess below the known range tells nothing new
        "Higher. Try 11.",
    ]
    for secret in range(1, 17):
        demo = env.demonstration({"secret": secret})
        feedback = [m.content for m in demo[1:] if m.role == "user"]
        assert all(len(re.findall(r"\d+", text)) == 1 for text in feedback), feedback
        replies = [m.content for m in demo if m.role == "assistant"]
        replayed = await play(make_env("guess_number", {"feedback": "try"}), secret, replies)
        assert [r.messages[0].content for r in replayed[:-1]] == feedback
        assert replayed[-1].done and replayed[-1].reward > 0


async def test_blind_demonstration_guesses_at_random_and_replays():
    """`demo_bisect = 0`: the warm-up sees the reply format with guesses that ignore the feedback, varied per
    task, and each demonstration is a conversation the env itself produces (a miss on the last guess ends it)."""
    kwargs = {"feedback": "hint", "turn_cost": 0.1, "demo_bisect": 0.0}
    env = make_env("guess_number", kwargs)
    tasks = env.sample_tasks(7, 200)
    # the secrets are those of the same seed without demonstration seeds (earlier runs' tasks are unchanged)
    rng = random.Random(7)
    assert [t["secret"] for t in tasks] == [rng.randint(1, 16) for _ in range(200)]
    guesses, bisect_like, lengths = [], 0, Counter()
    for task in tasks:
        demo = env.demonstration(task)
        assert demo == env.demonstration(task)  # deterministic per task
        replies = [m.content for m in demo if m.role == "assistant"]
        lengths[len(replies)] += 1
        results = await play(make_env("guess_number", kwargs), task["secret"], replies)
        assert [m for r in results for m in r.messages] == [m for m in demo[1:] if m.role == "user"]
        assert results[-1].done and len(results) == len(replies)
        guesses += [int(r) for r in replies]
        bisect_like += replies[0] == "8"
    assert set(guesses) == set(range(1, 17))  # every number of the range, not one fixed strategy
    assert bisect_like < 40  # the first guess is the hint only by chance (1 in 16)
    assert lengths[5] > 100  # most blind searches use all five guesses (72% miss)


def test_blind_demonstrations_differ_between_tasks_with_one_secret():
    env = make_env("guess_number", {"demo_bisect": 0.0})
    tasks = [t for t in env.sample_tasks(3, 300) if t["secret"] == 5][:5]
    assert len({tuple(m.content for m in env.demonstration(t)) for t in tasks}) > 1


async def test_demo_bisect_mixes_hint_following_into_the_demonstrations():
    """0 < demo_bisect < 1: about that share of the demonstration guesses is the binary search's (the hint), the
    rest blind; the warm-up thus seeds the habit RL is to strengthen."""
    env = make_env("guess_number", {"feedback": "hint", "demo_bisect": 0.3})
    followed = total = 0
    for task in env.sample_tasks(11, 400):
        demo = env.demonstration(task)
        for before, reply in itertools.pairwise(demo):
            if reply.role == "assistant":
                total += 1
                followed += before.content.endswith(f"Try {reply.content}.")
    # blind guesses equal the hint 1 time in 16 on the first turn and more often as the range shrinks
    assert 0.3 < followed / total < 0.45, followed / total
