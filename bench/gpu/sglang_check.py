"""agentrl's SGLang adapter against a real SGLang server on the GPU machine.

    python3 bench/gpu/sglang_check.py --out $OUT [--dist-backend gloo|nccl] [--sglang-<flag> VALUE ...]

Writes a random-init Qwen3-0.6B-architecture HF directory, launches `sglang.launch_server` through
`SGLangServer` (every `--sglang-*` flag passes through), generates with logprobs through `SGLangEngine`, then
publishes versions 1, 2, 3, ... from an HF "learner" on the same GPU through each hot-reload path:
`update_weights_from_tensor` (CUDA-IPC payload), `init_weights_update_group` + `update_weights_from_distributed`
(per tensor and in flattened buckets), `update_weights_from_disk`. Every version perturbs all weights; after
each publish the server must report the new `weight_version` and its logprobs on sampled tokens must match a
teacher-forced HF forward pass of the published weights (mean |d| <= 1e-2, bf16). NCCL refuses two ranks on
one GPU, so on one GPU the distributed path runs over gloo (`--dist-backend gloo`); with two GPUs pass
`--server-gpu 1 --dist-backend nccl` (the learner stays on GPU 0). Prints one JSON summary line at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from agentrl.engines.base import DiskSource, SamplingParams, TensorSource
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_launcher import SGLangServer, parse_sglang_flags
from agentrl.engines.weight_sync import (
    describe,
    init_weights_update_group,
    plan_buckets,
    send_broadcast,
    send_bucket,
)
from agentrl.net import free_port

DEFAULT_FLAGS = [
    "--sglang-attention-backend", "triton", "--sglang-sampling-backend", "pytorch",
    "--sglang-grammar-backend", "none", "--sglang-disable-piecewise-cuda-graph",
    "--sglang-skip-server-warmup", "--sglang-skip-tokenizer-init", "--sglang-mem-fraction-static", "0.5",
]  # fmt: skip
TOL = 1e-2


def build_model(root: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from engine_bench import build_model as bench_build

    return bench_build("qwen3-0.6b", root, "bfloat16", "cuda")


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output, device=model.device)[:, None])[:, 0]


async def sample_and_compare(engine: SGLangEngine, model, prompts, version: int, prev=None) -> dict:
    sp = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)
    outs = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
    diffs, prev_diffs, stamped = [], [], []
    for p, o in zip(prompts, outs, strict=True):
        got = torch.tensor(o.logprobs, device=model.device)
        diffs.append((got - hf_logprobs(model, p, o.output_ids)).abs())
        stamped.append(o.versions == [(version, len(o.output_ids))])
        if prev is not None:
            prev_diffs.append((got - hf_logprobs(prev, p, o.output_ids)).abs())
    d = torch.cat(diffs)
    row = {
        "version": version,
        "versions_ok": all(stamped),
        "logprob_mean_abs_diff": round(float(d.mean()), 5),
        "logprob_max_abs_diff": round(float(d.max()), 5),
        "tokens": int(d.numel()),
    }
    if prev_diffs:
        row["vs_previous_weights_mean_abs_diff"] = round(float(torch.cat(prev_diffs).mean()), 4)
    row["ok"] = row["versions_ok"] and row["logprob_mean_abs_diff"] <= TOL
    return row


def perturb(
    model, base: dict[str, torch.Tensor], seed: int, only: Callable[[str], bool] | None = None
) -> int:
    """New weights at the scale of the initial ones: matrices 0.8 * base + 0.6 * fresh noise of the base's std
    (same variance, a different function), 1-D norms base + N(0, 0.02); `only`: the parameter names to change
    (default all). Returns how many tensors changed."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is not None and not only(name):
                continue
            b = base[name]
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            if p.dim() > 1:
                p.copy_(0.8 * b.float() + 0.6 * b.float().std() * noise)
            else:
                p.copy_(b.float() + 0.02 * noise)
            changed += 1
    return changed


def snapshot(model):
    import copy

    return copy.deepcopy(model)


async def main_async(args, flags: dict) -> dict:
    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = build_model(root)
    env = {"CUDA_VISIBLE_DEVICES": str(args.server_gpu)} if args.server_gpu is not None else None
    server = SGLangServer(str(path), args=flags, env=env, log_path=str(out / "sglang_server.log"),
                          startup_timeout_s=600, restart_on_crash=False)  # fmt: skip
    await asyncio.to_thread(server.start)
    result: dict = {
        "startup_s": round(time.perf_counter() - t0, 1),
        "flags": flags,
        "checks": [],
        "publish": [],
    }
    engine = SGLangEngine(server.url, update_timeout_s=300)
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda:0").eval()
    vocab = learner.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(vocab, (n,), generator=g).tolist() for n in (16, 32, 64, 128)]
    base = {n: p.detach().clone() for n, p in learner.named_parameters()}
    try:
        result["checks"].append({"path": "initial", **await sample_and_compare(engine, learner, prompts, 0)})
        for version, path_name in enumerate(args.paths.split(","), start=1):
            prev = snapshot(learner)
            perturb(learner, base, version)
            named = [(n, p.detach()) for n, p in learner.named_parameters()]
            torch.cuda.synchronize()
            timing = await publish(engine, path_name, version, named, learner, root, args)
            result["publish"].append({"path": path_name, "version": version, **timing})
            check = await sample_and_compare(engine, learner, prompts, version, prev)
            result["checks"].append({"path": path_name, **check})
            print(json.dumps(result["checks"][-1] | timing), flush=True)
            del prev
        await engine.pause("keep")
        await engine.resume()
        await engine.flush_cache()
        result["pause_resume_flush_ok"] = True
        result["health"] = await engine.health()
    finally:
        await engine.close()
        await asyncio.to_thread(server.stop)
    result["all_ok"] = all(c["ok"] for c in result["checks"])
    return result


async def publish(engine, path_name, version, named, learner, root: Path, args) -> dict:
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    start = time.perf_counter()
    if path_name == "tensor":
        await engine.update_weights(version, TensorSource(named))
    elif path_name == "disk":
        target = root / f"v{version}"
        learner.save_pretrained(target, safe_serialization=True)
        saved = time.perf_counter()
        await engine.update_weights(version, DiskSource(str(target)))
        return {"save_s": round(saved - start, 3), "seconds": round(time.perf_counter() - saved, 3),
                "gb": round(nbytes / 1e9, 3)}  # fmt: skip
    elif path_name in ("distributed", "distributed_bucketed"):
        group_name = f"agentrl_{path_name}_{version}"
        port = free_port()
        holder: dict = {}

        def host():
            holder["group"] = init_weights_update_group(
                "127.0.0.1", port, 0, 2, backend=args.dist_backend, group_name=group_name
            )

        thread = threading.Thread(target=host)
        thread.start()
        await engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name, args.dist_backend)
        thread.join()
        group = holder["group"]
        joined = time.perf_counter()
        if path_name == "distributed":
            meta = describe(group_name, named)
            await asyncio.gather(
                asyncio.to_thread(send_broadcast, group, named), engine.update_weights(version, meta)
            )
        else:
            for bucket in plan_buckets(named, args.bucket_mb << 20):
                meta = describe(group_name, bucket, load_format="flattened_bucket")
                await asyncio.gather(
                    asyncio.to_thread(send_bucket, group, bucket), engine.update_weights(version, meta)
                )
        torch.cuda.synchronize()
        end = time.perf_counter()
        return {"join_s": round(joined - start, 3), "seconds": round(end - joined, 3),
                "gb_per_s": round(nbytes / 1e9 / (end - joined), 2), "gb": round(nbytes / 1e9, 3),
                "backend": args.dist_backend}  # fmt: skip
    else:
        raise SystemExit(f"--paths: unknown path {path_name!r}")
    elapsed = time.perf_counter() - start
    return {
        "seconds": round(elapsed, 3),
        "gb": round(nbytes / 1e9, 3),
        "gb_per_s": round(nbytes / 1e9 / elapsed, 2),
    }


def main() -> None:
    flags, rest = parse_sglang_flags(sys.argv[1:])
    default_flags, _ = parse_sglang_flags(DEFAULT_FLAGS)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sglang_check"))
    ap.add_argument("--workdir", default="/tmp/agentrl_sglang_check")
    ap.add_argument("--paths", default="tensor,distributed,distributed_bucketed,disk,tensor")
    ap.add_argument("--dist-backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--server-gpu", type=int, default=None)
    args = ap.parse_args(rest)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = asyncio.run(main_async(args, default_flags | flags))
    line = json.dumps(result)
    (Path(args.out) / "sglang_check.json").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
