"""The math reward is math-verify's comparison (HF `math-verify`) of our extracted final answer, chosen over
the hand-written comparer by their agreement with the labelled pairs in bench/data/math_answers.jsonl; without
the extra the hand-written comparer is the fallback, with a warning naming the pip extra."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("math_verify")

from agentrl.rewards import math_reward
from agentrl.rewards.math_verify import builtin_math_reward, library_math_reward

DATA = Path(__file__).parents[1] / "bench" / "data" / "math_answers.jsonl"


def sample() -> list[dict]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    assert len(rows) >= 200 and {r["category"] for r in rows} >= {
        "fraction",
        "unit",
        "interval",
        "set",
        "boxed",
    }
    return rows[::3]  # every category, a third of the pairs: quick


def accuracy(fn, rows) -> float:
    return sum((fn(r["response"], r["reference"]) == 1.0) == r["equal"] for r in rows) / len(rows)


def test_math_reward_agrees_with_the_labels_better_than_the_hand_written_comparer():
    rows = sample()
    ours, hand = accuracy(math_reward, rows), accuracy(builtin_math_reward, rows)
    assert ours >= 0.95, ours
    assert ours > hand


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("first \\boxed{3}, then I corrected it: \\boxed{5}", "5", 1.0),  # the last box is the answer
        ("first \\boxed{3}, then I corrected it: \\boxed{5}", "3", 0.0),
        ("\\fbox{12}", "12", 1.0),
        ("so \\boxed 12", "12", 1.0),
        ("$\\boxed{(-\\infty, 2) \\cup (3, \\infty)}$", "(-\\infty,2)\\cup(3,\\infty)", 1.0),
        ("\\boxed{\\{1, 2, 3\\}}", "\\{3, 2, 1\\}", 1.0),
        ("Therefore $x = \\frac{1}{2}$.", "0.5", 1.0),
        ("Therefore $x = \\frac{1}{2}$.", "2", 0.0),
        ("\\boxed{}", "0", 0.0),
    ],
)
def test_cases_the_hand_written_comparer_or_the_library_alone_got_wrong(response, reference, expected):
    assert math_reward(response, reference) == expected


def test_unboxed_can_still_be_required():
    assert library_math_reward("Therefore $x = \\frac{1}{2}$.", "0.5", allow_unboxed=False) == 0.0


def test_works_off_the_main_thread():
    """Ray's async actors call rewards off the main thread, where math-verify's signal timeout cannot run."""
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.append(math_reward("\\boxed{\\frac{2}{4}}", "0.5")))
    thread.start()
    thread.join(60)
    assert out == [1.0]


def test_without_the_extra_the_hand_written_comparer_is_used_with_a_warning():
    code = (
        "import sys, warnings\nsys.modules['math_verify'] = None  # as when agentrl[math-verify] is not installed\n"
        "from agentrl.rewards import math_reward\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(math_reward('\\\\boxed{\\\\frac12}', '0.5'), math_reward('\\\\boxed{2\\\\sqrt{2}}', '\\\\sqrt{8}'))\n"
        "print(len(caught), caught[0].message)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    scores, warning = out.stdout.splitlines()
    assert scores == "1.0 0.0"  # the fallback knows fractions, not surds
    assert warning.startswith("1 ") and "pip install 'agentrl[math-verify]'" in warning
