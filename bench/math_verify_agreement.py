"""How often each math comparer is right on a labelled set of answer pairs (bench/data/math_answers.jsonl).

Each row: `response` (a model reply), `reference` (the gold answer), `equal` (the truth), `category`
(fraction, number, unit, percent, degree, interval, set, expression, wrong, boxed, unboxed). Prints the
accuracy of agentrl's hand-written comparer (`builtin_math_reward`), of agentrl's reward with math-verify
(`library_math_reward`: our last-box extraction, math-verify's comparison) and of math-verify used alone
(`parse` + `verify` on the whole reply), per category and overall, plus the rows each gets wrong (`-v`).

    PYTHONPATH=$PWD python bench/math_verify_agreement.py [--markdown] [-v]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

DATA = Path(__file__).parent / "data" / "math_answers.jsonl"


def load_rows(path: Path = DATA) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def math_verify_alone(response: str, reference: str) -> float:
    from math_verify import parse, verify

    gold = parse(reference if "\\boxed" in reference else f"${reference}$")
    return float(verify(gold, parse(response)))


def comparers() -> dict[str, object]:
    from agentrl.rewards.math_verify import builtin_math_reward, library_math_reward

    return {
        "hand-written": builtin_math_reward,
        "agentrl + math-verify": library_math_reward,
        "math-verify alone": math_verify_alone,
    }


def score(rows: list[dict]) -> tuple[dict[str, dict[str, list[int]]], dict[str, list[dict]]]:
    """Per comparer: category -> [right, total], and the rows it got wrong."""
    right: dict[str, dict[str, list[int]]] = {}
    wrong: dict[str, list[dict]] = {}
    for name, fn in comparers().items():
        tally = right.setdefault(name, collections.defaultdict(lambda: [0, 0]))
        for row in rows:
            ok = (fn(row["response"], row["reference"]) == 1.0) == row["equal"]
            tally[row["category"]][0] += ok
            tally[row["category"]][1] += 1
            if not ok:
                wrong.setdefault(name, []).append(row)
    return right, wrong


def table(right: dict[str, dict[str, list[int]]], markdown: bool) -> str:
    names = list(right)
    cats = list(next(iter(right.values())))
    lines = ["| category | pairs | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for cat in [*cats, "all"]:
        cells = []
        for name in names:
            r, n = map(sum, zip(*right[name].values(), strict=True)) if cat == "all" else right[name][cat]
            cells.append(f"{r}/{n} ({100 * r / n:.1f}%)")
        total = sum(v[1] for v in right[names[0]].values()) if cat == "all" else right[names[0]][cat][1]
        lines.append(f"| {cat} | {total} | " + " | ".join(cells) + " |")
    return (
        "\n".join(lines)
        if markdown
        else "\n".join(line.replace("|", " ") for line in lines if "---" not in line)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("-v", "--verbose", action="store_true", help="list the rows each comparer gets wrong")
    args = parser.parse_args()
    right, wrong = score(load_rows())
    print(table(right, args.markdown))
    if args.verbose:
        for name, rows in wrong.items():
            print(f"\n{name} wrong on {len(rows)}:")
            for row in rows:
                print(
                    f"  [{row['category']}] {row['response']!r} vs {row['reference']!r}: truth {row['equal']}"
                )


if __name__ == "__main__":
    main()
