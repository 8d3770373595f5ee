"""Rewards: exact match, the math verifier (extraction, normalisation, equivalences), custom loaders and
the dynamic-sampling filter with over-sampling."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrl.errors import ConfigError
from agentrl.rewards import (
    exact_match,
    extract_answer,
    extract_boxed,
    is_informative,
    load_reward,
    math_reward,
    normalize_answer,
)


def test_exact_match():
    assert exact_match(" 42\n", "42") == 1.0
    assert exact_match("42.", 42) == 1.0
    assert exact_match("Paris", ["paris", "Paris"]) == 1.0
    assert exact_match("paris", "Paris") == 0.0
    assert exact_match("paris", "Paris", ignore_case=True) == 1.0
    assert exact_match("421", "42") == 0.0


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{a_{b}^{c}} end", "a_{b}^{c}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5$", "5"),
        ("\\boxed{unclosed", None),
        ("no box", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_answer_fallback():
    assert extract_answer("I think 3, no wait, 1,234.") == "1,234"
    assert extract_answer("I think 3", allow_unboxed=False) is None
    assert extract_answer("nothing here") is None


@pytest.mark.parametrize(
    "response,reference",
    [
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac{1}{2}}", "1/2"),
        ("\\boxed{\\frac12}", "0.5"),
        ("\\boxed{50\\%}", "0.5"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{x = 3}", "3"),
        ("\\boxed{90^\\circ}", "90"),
        ("\\boxed{\\text{5}}", "5"),
        ("\\boxed{(1, 2)}", "(1,2)"),
        ("\\boxed{\\left( 1,\\frac{1}{2} \\right)}", "(1, 0.5)"),
        ("\\boxed{\\sqrt2}", "\\sqrt{2}"),
        ("\\boxed{-3}", "-3.0"),
        ("The answer is 12", "12"),
        ("\\boxed{12}", "The final answer is \\boxed{12}"),
        ("\\boxed{b}", ["a", "b"]),
    ],
)
def test_math_equivalent(response, reference):
    assert math_reward(response, reference) == 1.0


@pytest.mark.parametrize(
    "response,reference",
    [
        ("\\boxed{0.51}", "1/2"),
        ("\\boxed{(1, 2)}", "[1, 2]"),
        ("\\boxed{(1, 2)}", "(1, 2, 3)"),
        ("\\boxed{12} but really 13", "13"),  # the boxed answer wins over later numbers
        ("no answer", "3"),
        ("\\boxed{}", "0"),
        ("\\boxed{1/0}", "0"),
    ],
)
def test_math_not_equivalent(response, reference):
    assert math_reward(response, reference) == 0.0


def test_math_unboxed_can_be_required():
    assert math_reward("12", "12", allow_unboxed=False) == 0.0


@given(st.integers(-(10**9), 10**9))
def test_integer_forms_agree(n):
    assert math_reward(f"\\boxed{{{n}}}", str(n)) == 1.0
    assert math_reward(f"\\boxed{{{n}}}", str(n + 1)) == 0.0
    assert normalize_answer(f"${n}$") == str(n)


def test_load_reward():
    assert load_reward("exact_match")("3", {"answer": 3}) == 1.0
    assert load_reward("math")("\\boxed{3}", {"answer": "3"}) == 1.0
    assert load_reward("tests.test_rewards:length_reward")("abc", {}) == 3.0
    spec = "tests.test_rewards"
    for bad in ("", "exact", f"{spec}:", f"{spec}:missing", f"{spec}:NOT_CALLABLE"):
        with pytest.raises(ConfigError, match=r"env\.reward"):
            load_reward(bad)


def length_reward(response, task):
    return float(len(response))


NOT_CALLABLE = 3


def test_a_group_is_informative_when_its_rewards_differ():
    assert is_informative([0.0, 0.0, 1e-3]) and is_informative([1.0, 0.0])
    assert not is_informative([0.5, 0.5 + 1e-9]) and not is_informative([1.0, 1.0])
    assert not is_informative([0.3])  # a group of one has no spread
