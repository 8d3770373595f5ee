"""Where a decode step of the embedded engine spends its time, by batch size and KV length (for the next GPU call).

    python3 bench/gpu/profile_decode.py --out $OUT                  # Qwen3-0.6B arch, bf16, CUDA
    python3 bench/gpu/profile_decode.py --device cpu --arch tiny    # CPU smoke test (eager SDPA only)

For each (batch B, KV length L): the model step alone (CUDA graph replay with the Triton kernel; eager SDPA;
eager Triton), sampling (torch ops on [B, vocab] fp32 logits; the fused kernel on model-dtype logits), and
the runner's whole `decode()` (host bookkeeping, H2D, step, sampling, one D2H). Times are medians of CUDA-event-timed repeats (host clock on CPU). The floor column
is bytes that must move (weights once + K/V of B x L positions) over `--hbm-gb-s`. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from agentrl.engines.base import SamplingParams
from agentrl.engines.runner import ModelRunner, Request
from agentrl.engines.sampling import BatchSampling, sample


def timed(fn, device: str, repeats: int) -> float:
    """Median milliseconds of `fn()` (after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def fake_batch(b: int, length: int, vocab: int) -> list[Request]:
    loop = asyncio.new_event_loop()
    batch = []
    for i in range(b):
        r = Request(
            f"r{i}", [1] * (length - 1), SamplingParams(temperature=1.0), loop.create_future(), frozenset()
        )
        r.output_ids.append(i % vocab)
        batch.append(r)
    return batch


def profile_point(runner: ModelRunner, b: int, length: int, args) -> dict:
    model, cache, spec, dev, n = runner.model, runner.cache, runner.spec, args.device, args.repeats
    weight_bytes = sum(t.numel() * t.element_size() for t in model.params.values() if t.dim() == 2)
    tokens = torch.randint(spec.vocab_size, (b,), device=dev)
    pos = torch.full((b,), length - 1, dtype=torch.int64, device=dev)
    row: dict = {"batch": b, "kv_len": length}
    kv_bytes = 2 * spec.layers * b * length * spec.kv_heads * spec.head_dim * cache.k[0].element_size()
    row["floor_ms"] = round((weight_bytes + kv_bytes) / (args.hbm_gb_s * 1e9) * 1e3, 3)
    if runner.graphs is not None:
        row["graph_ms"] = timed(lambda: runner.graphs(tokens, pos, length), dev, n)
    row["eager_sdpa_ms"] = timed(lambda: model.decode(tokens, pos, cache, length), dev, n)
    if dev.startswith("cuda"):
        row["eager_triton_ms"] = timed(
            lambda: model.decode(tokens, pos, cache, length, attention="triton"), dev, n
        )
    logits = torch.randn(b, spec.vocab_size, device=dev)
    params = BatchSampling([1.0] * b, [1.0] * b, [-1] * b, torch.device(dev))
    row["sample_ms"] = timed(lambda: sample(logits, params, None, runner.generator), dev, n)
    if runner.fused_sampling:  # one Triton kernel on the model-dtype logits the step returns
        fused = BatchSampling([1.0] * b, [1.0] * b, [-1] * b, torch.device(dev), seeds=list(range(b)))
        raw = logits.to(model.dtype)
        row["sample_fused_ms"] = timed(lambda: sample(raw, fused, None, None, pos), dev, n)
    batch = fake_batch(b, length, spec.vocab_size)
    row["runner_decode_ms"] = timed(lambda: runner.decode(batch, []), dev, n)
    return row


def kernel_profile(runner: ModelRunner, b: int, length: int, device: str) -> dict:
    """CUDA kernels of one eager decode step (compiled layer halves if the runner compiled them)."""
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(runner.spec.vocab_size, (b,), device=device)
    pos = torch.full((b,), length - 1, dtype=torch.int64, device=device)
    step = lambda: runner.model.decode(tokens, pos, runner.cache, length, attention=runner.attention)  # noqa: E731
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    top: dict[str, float] = {}
    for e in kernels:
        top[e.name[:70]] = top.get(e.name[:70], 0.0) + e.device_time_total / 1e3
    best = sorted(top.items(), key=lambda kv: -kv[1])[:10]
    return {"batch": b, "kv_len": length, "compiled": runner.compiled, "kernels": len(kernels),
            "kernel_ms": round(sum(top.values()), 3), "top_ms": [[n, round(t, 3)] for n, t in best]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["qwen3-0.6b", "tiny"], default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--hbm-gb-s", type=float, default=4300.0, help="measured copy bandwidth (H200: ~4.3 TB/s)"
    )
    ap.add_argument("--workdir", default="/tmp/agentrl_profile")
    ap.add_argument("--out", default="")
    ap.add_argument("--no-kernels", action="store_true", help="skip the per-kernel profiles")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    batches = [int(x) for x in args.batches.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from engine_bench import build_model

    dtype = "bfloat16" if cuda else "float32"
    path = build_model(args.arch, Path(args.workdir), dtype, args.device)
    runner = ModelRunner(str(path), args.device, dtype, max(batches), max(lengths) + 1, cuda_graphs=cuda,
                         attention="triton" if cuda else "sdpa")  # fmt: skip
    rows = []
    for length in lengths:
        for b in batches:
            rows.append(profile_point(runner, b, length, args))
            print(json.dumps(rows[-1]), flush=True)
    result = {"arch": args.arch, "device": args.device, "gpu": torch.cuda.get_device_name() if cuda else None,
              "compiled": runner.compiled, "rows": rows}  # fmt: skip
    if cuda and not args.no_kernels:
        result["kernels"] = [kernel_profile(runner, b, 1024, args.device) for b in (1, 64)]
        runner.model.compile_decode(False)
        result["kernels"] += [kernel_profile(runner, b, 1024, args.device) for b in (1, 64)]
        for k in result["kernels"]:
            print(json.dumps(k), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_decode.json").write_text(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
