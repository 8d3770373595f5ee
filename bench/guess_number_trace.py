"""guess_number: what the model says, turn by turn, in a run's trained trajectories.

    python bench/guess_number_trace.py RUN_DIR [--every 10] [--examples 3]

Reads the run's `queue.wal` (every trajectory the rollout workers sent, in arrival order; a step's worth is
prompts_per_step x n_samples_per_prompt of them), replays each one's replies through the env of the run's
`config.toml`, and prints per block of `--every` steps: the share of groups whose rewards differ (the only ones GRPO learns from), the mean
reward, and per turn how the guesses fall: `bisect` (the midpoint of the range the feedback so far allows, the
hint under `feedback = "hint"`), `in_range` (another number in that range), `out` (a number outside it: the
feedback already ruled it out), `none` (no number); then the replies of the block's first `--examples`
trajectories.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np


def load(run: Path):
    """The run's config and its trajectories in the order the queue received them."""
    from agentrl.config import load_config
    from agentrl.queue.recovery import scan
    from agentrl.queue.walformat import PutRecord

    trajs = []

    def keep(record):
        if isinstance(record, PutRecord):
            trajs.extend(record.trajectories)

    scan((run / "queue.wal").read_bytes(), keep)
    return load_config(run / "config.toml"), trajs


def replies(traj, tokenizer) -> list[str]:
    """The model's reply of each turn: the runs of loss-mask ones in the response."""
    from agentrl.types.trajectory import TOKEN_DTYPE, mask

    ids = np.frombuffer(traj.response_ids, dtype=TOKEN_DTYPE)
    m, out, cur = mask(traj), [], []
    for tok, bit in zip(ids.tolist(), m.tolist(), strict=True):
        if bit:
            cur.append(tok)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return [tokenizer.decode(r, skip_special_tokens=True).strip() for r in out]


async def classify(env, secret: int, texts: list[str]) -> list[str]:
    """Each reply's kind, replayed through the env (its `range` is what the feedback so far allows)."""
    from agentrl.envs.guess_number import first_int

    await env.reset({"secret": secret})
    kinds = []
    for text in texts:
        lo, hi = env.range
        guess = first_int(text)
        if guess is None:
            kinds.append("none")
        elif guess == (lo + hi) // 2:
            kinds.append("bisect")
        else:
            kinds.append("in_range" if lo <= guess <= hi else "out")
        if (await env.step(text)).done:
            break
    return kinds


def block_stats(env, tokenizer, trajs: list, examples: int) -> dict:
    groups = defaultdict(list)
    for t in trajs:
        groups[t.group_id].append(t.reward)
    informative = sum(len(set(r)) > 1 for r in groups.values()) / max(len(groups), 1)
    per_turn: dict[int, Counter] = defaultdict(Counter)
    shown = []
    for t in trajs:
        texts = replies(t, tokenizer)
        kinds = asyncio.run(classify(env, int(t.metadata["env_info"]["secret"]), texts))
        for turn, kind in enumerate(kinds):
            per_turn[turn + 1][kind] += 1
        if len(shown) < examples:
            shown.append(f"secret {t.metadata['env_info']['secret']:>2} reward {t.reward:.1f}: {texts}")
    share = {
        turn: {k: round(c[k] / sum(c.values()), 2) for k in ("bisect", "in_range", "out", "none")}
        for turn, c in sorted(per_turn.items())
    }
    return {
        "reward": round(float(np.mean([t.reward for t in trajs])), 3),
        "informative_groups": round(informative, 2),
        "per_turn": share,
        "examples": shown,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--examples", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from agentrl.envs import make_env

    cfg, trajs = load(args.run)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    env = make_env(cfg.env.name, cfg.env.kwargs)
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    for start in range(0, len(trajs) // per_step * per_step, per_step * args.every):
        block = trajs[start : start + per_step * args.every]
        stats = block_stats(env, tokenizer, block, args.examples)
        steps = f"{start // per_step + 1}-{(start + len(block)) // per_step}"
        print(json.dumps({"steps": steps, **stats}))


if __name__ == "__main__":
    main()
