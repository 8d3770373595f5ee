"""The eval numbers (agentrl.runner.evaluation.summarize): pass@k and avg@n against brute force over every
k-subset of a prompt's samples, standard errors over prompts, and the metric names each kind of set logs."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.runner.evaluation import SUCCESS_REWARD, pass_at_k, summarize


def samples_of(rewards: list[list[float]]) -> list[dict]:
    """The worker's sample dicts for per-prompt reward lists."""
    return [
        {"prompt_index": i, "sample_index": k, "reward": r}
        for i, row in enumerate(rewards)
        for k, r in enumerate(row)
    ]


def brute_pass_at(row: list[float], k: int) -> float:
    """The share of the k-subsets of the samples that hold a success: the chance that k of the n samples,
    drawn without replacement, include one."""
    subsets = list(itertools.combinations(row, k))
    return sum(any(r >= SUCCESS_REWARD for r in s) for s in subsets) / len(subsets)


def brute_avg_at(row: list[float], k: int) -> float:
    """The mean over every k-subset of the subset's success rate."""
    subsets = list(itertools.combinations(row, k))
    return sum(sum(r >= SUCCESS_REWARD for r in s) / k for s in subsets) / len(subsets)


@st.composite
def reward_rows(draw):
    """1-4 prompts with the same 1-7 samples each; rewards 0, a partial 0.3, or a success."""
    n = draw(st.integers(1, 7))
    row = st.lists(st.sampled_from([0.0, 0.3, 1.0]), min_size=n, max_size=n)
    return draw(st.lists(row, min_size=1, max_size=4))


@settings(max_examples=60, deadline=None)
@given(reward_rows())
def test_pass_at_k_and_avg_equal_brute_force_over_subsets(rewards):
    result = summarize("set", samples_of(rewards))
    n = len(rewards[0])
    assert sorted(result.pass_at) == sorted({*[2**i for i in range(n.bit_length()) if 2**i < n], n})
    for k, value in result.pass_at.items():
        expected = sum(brute_pass_at(row, k) for row in rewards) / len(rewards)
        assert value == pytest.approx(expected, abs=1e-12)
    for k in range(1, n + 1):  # avg@k is the same for every k: the mean success rate
        assert result.avg == pytest.approx(sum(brute_avg_at(row, k) for row in rewards) / len(rewards))
    assert result.mean_reward == pytest.approx(sum(sum(r) / n for r in rewards) / len(rewards))


def test_pass_at_k_of_a_known_case():
    # 5 samples, 2 right: 3 of the 10 pairs hold no success (C(3,2)), so pass@2 = 7/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 1, 5) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def test_standard_errors_are_over_prompts():
    # two prompts, one always right and one always wrong: per-prompt pass@1 values 1 and 0, whose sample
    # standard deviation is sqrt(1/2); over sqrt(2) prompts: 0.5
    result = summarize("set", samples_of([[1.0, 1.0], [0.0, 0.0]]))
    assert result.se["pass@1"] == pytest.approx(0.5)
    assert result.se["avg@2"] == pytest.approx(0.5)
    assert result.se["mean_reward"] == pytest.approx(0.5)
    # rewards 0.2 and 0.6 on one prompt, 0.4 and 0.4 on the other: prompt means 0.4 and 0.4, no spread
    assert summarize("set", samples_of([[0.2, 0.6], [0.4, 0.4]])).se["mean_reward"] == pytest.approx(0.0)
    one = summarize("set", samples_of([[1.0, 0.0]]))
    assert one.se == {} and "pass@1_se" not in one.values()  # one prompt: no standard error


def test_metric_names_of_the_run_set_and_of_a_named_set():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.5]]
    named = summarize("hard", samples_of(rewards)).metrics()
    values = ["mean_reward", "pass@1", "pass@2", "pass@4", "avg@4"]
    assert set(named) == {f"eval/hard/{k}" for k in [*values, *(f"{v}_se" for v in values), "samples"]}
    assert named["eval/hard/pass@4"] == 0.5 and named["eval/hard/samples"] == 8.0
    assert named["eval/hard/pass@1_se"] == pytest.approx(statistics.stdev([0.5, 0.0]) / math.sqrt(2))
    # the run's own set keeps the keys runs have always logged
    own = summarize("default", samples_of([[1.0], [0.0], [0.5]])).metrics()
    assert own == {
        "eval_reward_mean": pytest.approx(0.5),
        "eval_success": pytest.approx(1 / 3),
        "eval_n": 3.0,
    }


def test_a_prompt_with_fewer_samples_counts_with_what_it_has():
    # an episode that produced nothing leaves its prompt one sample short: pass@k goes up to the k all reach
    result = summarize("set", samples_of([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    assert sorted(result.pass_at) == [1, 2, 3]
    assert result.pass_at[3] == pytest.approx((brute_pass_at([1.0, 0, 0, 0], 3) + 1.0) / 2)
