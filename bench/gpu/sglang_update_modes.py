"""Publishing into a busy SGLang server: `engine.update_mode` keep vs abort vs no publish, long generations.

    python3 bench/gpu/sglang_update_modes.py --out $OUT     # one GPU; real SGLang (bench/gpu/common.sh gpu_install sglang)

Qwen3-0.6B arch (random weights), `--n` requests of 64 prompt tokens and `--new-tokens` output tokens each (eos
ignored) through agentrl's `SGLangEngine`; `--publish-after-s` into the run, the same weights are published as
version 1 by `update_weights_from_tensor` (CUDA IPC, learner copy on the same GPU) through
`agentrl.actors.broadcast.load_into_engines` with the mode under test. Cut requests (abort) are continued from
their partial output, as agentrl/generators/multi_turn.py does. Per mode: publish latency (call to return), wall time
until every request has all its tokens, continuations, and the versions the tokens were stamped with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import torch

from agentrl.actors.broadcast import load_into_engines
from agentrl.engines.base import SamplingParams, TensorSource
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_launcher import SGLangServer


async def continued(engine: SGLangEngine, prompt: list[int], new_tokens: int) -> dict:
    """Generate `new_tokens`, continuing from the partial output after every abort."""
    got: list[int] = []
    versions: list[tuple[int, int]] = []
    parts = 0
    while len(got) < new_tokens:
        sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens - len(got), ignore_eos=True)
        out = await engine.generate(prompt + got, sp)
        got += out.output_ids
        versions += [tuple(v) for v in out.versions]
        parts += 1
        if out.finish_reason != "abort" and len(got) < new_tokens:
            raise RuntimeError(f"request ended with {out.finish_reason} after {len(got)} tokens")
    return {"tokens": len(got), "parts": parts, "versions": versions}


async def trial(engine, learner, prompts, args, mode: str | None, version: int) -> dict:
    start = time.perf_counter()
    tasks = [asyncio.create_task(continued(engine, p, args.new_tokens)) for p in prompts]
    publish_s = None
    if mode is not None:
        await asyncio.sleep(args.publish_after_s)
        t0 = time.perf_counter()
        named = {n: p.detach() for n, p in learner.named_parameters()}
        await load_into_engines([engine], version, TensorSource(named), mode)
        publish_s = round(time.perf_counter() - t0, 3)
    outs = await asyncio.gather(*tasks)
    wall_s = time.perf_counter() - start
    tokens = sum(o["tokens"] for o in outs)
    stamps: dict[int, int] = {}
    for o in outs:
        for v, n in o["versions"]:
            stamps[v] = stamps.get(v, 0) + n
    return {"mode": mode or "no publish", "publish_s": publish_s, "wall_s": round(wall_s, 2),
            "tok_s": round(tokens / wall_s), "continuations": sum(o["parts"] - 1 for o in outs),
            "tokens_by_version": stamps}  # fmt: skip


async def main_async(args) -> list[dict]:
    from engine_bench import SGLANG_FLAGS, build_model
    from transformers import AutoModelForCausalLM

    path = build_model("qwen3-0.6b", Path(args.workdir), "bfloat16", "cuda")
    flags = {**SGLANG_FLAGS, "mem_fraction_static": 0.5}
    server = SGLangServer(str(path), args=flags, log_path=f"{args.out}/sglang_update_modes.log",
                          startup_timeout_s=600, restart_on_crash=False)  # fmt: skip
    await asyncio.to_thread(server.start)
    engine = SGLangEngine(server.url, request_timeout_s=1800, update_timeout_s=600)
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(learner.config.vocab_size, (64,), generator=g).tolist() for _ in range(args.n)]
    rows = []
    try:
        await continued(engine, prompts[0], 8)  # warm-up
        for version, mode in enumerate((None, "keep", "abort", None), start=0):
            rows.append(await trial(engine, learner, prompts, args, mode, version))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        await engine.close()
        server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--workdir", default="/tmp/agentrl_update_modes")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=2048)
    ap.add_argument("--publish-after-s", type=float, default=1.0)
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = asyncio.run(main_async(args))
    (Path(args.out) / "sglang_update_modes.json").write_text(json.dumps(rows) + "\n")


if __name__ == "__main__":
    main()
