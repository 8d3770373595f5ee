"""How fast the tiny model learns a built-in env from its demonstrations (supervised, as the warm-up does):
greedy mean reward on held-out tasks every --eval-every steps, rolled out by the multi_turn generator on
the embedded engine.

    python bench/env_sft_curve.py [--env calculator] [--steps 600] [--eval-every 50]

Prints one line per evaluation: step, wall seconds, train loss, eval reward (greedy and temperature 1).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import tempfile
import time
from pathlib import Path

import torch


def batch(env, tok, seed: int, size: int):
    from agentrl.chat import demonstration_tokens

    rows = []
    for task in env.sample_tasks(seed, size):
        prompt, response, mask = demonstration_tokens(tok, env.demonstration(task))
        rows.append((prompt + response, [0] * len(prompt) + mask))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r, _ in rows])
    keep = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.bool)
    return ids, keep


async def evaluate(model_dir: Path, env_name: str, env_kwargs: dict, tok, n: int) -> tuple[float, float]:
    """Mean reward of `n` held-out tasks of the env made with `env_kwargs` (as in training): greedy, then t=1."""
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.envs import env_factory
    from agentrl.generator import RolloutContext, resolve_generator

    engine = EmbeddedEngine(str(model_dir), max_seq_len=256, max_batch_size=n)
    make = env_factory(env_name, env_kwargs)
    tasks = make().sample_tasks(10**9, n)
    out = []
    for temperature in (0.0, 1.0):
        ctx = RolloutContext(engine=engine, tokenizer=tok, make_env=make, env_name=env_name,
                             sampling=SamplingParams(temperature=temperature, max_new_tokens=16), max_turns=6)  # fmt: skip
        gen = resolve_generator("multi_turn")
        trajs = await asyncio.gather(*[gen(ctx, t, f"e{i}", "g") for i, t in enumerate(tasks)])
        out.append(sum(t.reward for t in trajs) / n)
    await engine.close()
    return out[0], out[1]


def main(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from agentrl.engines.tiny import make_tiny_model
    from agentrl.envs import make_env
    from agentrl.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    root = Path(tempfile.mkdtemp())
    make_tiny_model(root / "init", seed=args.seed)
    tok = load_tokenizer(root / "init")
    model = AutoModelForCausalLM.from_pretrained(str(root / "init"), dtype=torch.float32)
    env_kwargs = ast.literal_eval(args.env_kwargs) if args.env_kwargs else {}
    env = make_env(args.env, env_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    t0, loss = time.perf_counter(), float("nan")
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            model.save_pretrained(root / "eval")
            tok.save_pretrained(root / "eval")
            elapsed = time.perf_counter() - t0
            greedy, sampled = asyncio.run(evaluate(root / "eval", args.env, env_kwargs, tok, args.eval_tasks))
            print(
                f"step {step:4d}  train_s {elapsed:6.1f}  loss {loss:.4f}  reward greedy {greedy:.3f}  t=1 {sampled:.3f}",
                flush=True,
            )
            t0 = time.perf_counter() - elapsed  # evaluation time does not count
        if step == args.steps:
            break
        ids, keep = batch(env, tok, args.seed * 100_000 + step, args.batch_size)
        logits = model(ids).logits[:, :-1]
        loss_t = torch.nn.functional.cross_entropy(logits[keep[:, 1:]], ids[:, 1:][keep[:, 1:]])
        opt.zero_grad()
        loss_t.backward()
        opt.step()
        loss = loss_t.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="calculator")
    parser.add_argument("--env-kwargs", default="", help="a Python dict literal, e.g. \"{'high': 99}\"")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-tasks", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    main(parser.parse_args())
