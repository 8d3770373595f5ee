"""Decode-attention kernel configs (BLOCK_N, num_warps, num_stages) timed at engine-bench shapes.

    python3 bench/gpu/decode_kernel_sweep.py --out $OUT        # CUDA + triton
    TRITON_INTERPRET=1 python3 bench/gpu/decode_kernel_sweep.py --device cpu --quick   # CPU smoke (slow)

One layer's K/V cache of the Qwen3-0.6B arch (8 KV heads, head_dim 128, bf16), rows with KV lengths drawn
U[100, 2048) as in the 256-request engine bench, at several batch sizes. Each config is checked against the
default's output, then timed with CUDA events (median of `--repeats`). Reported: microseconds per call and
K/V bytes read per second; `best` is the config with the lowest summed time over the batch sizes, and
`speedup_vs_default` compares the two on the same shapes. Prints one JSON line (also `decode_kernel_sweep.json`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agentrl.engines.triton_attention import DEFAULT_KERNEL, decode_attention


def timed_us(fn, device: str, repeats: int) -> float:
    fn()
    if not device.startswith("cuda"):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="16,64,141,256")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="two configs, tiny shapes (CPU smoke)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/decode_kernel_sweep"))
    args = ap.parse_args()
    dev, dtype = args.device, torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    kv_heads, heads, dim, seq = 8, 16, 128, 2048
    batches = [int(b) for b in args.batches.split(",")]
    configs = [DEFAULT_KERNEL] + [
        c for c in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)) if c != DEFAULT_KERNEL
    ]
    if args.quick:
        batches, seq, configs = [3], 256, [DEFAULT_KERNEL, (32, 4, 2)]
    gen = torch.Generator().manual_seed(0)
    slots = max(batches)
    k = torch.randn(slots, kv_heads, seq, dim, generator=gen).to(dev, dtype)
    v = torch.randn(slots, kv_heads, seq, dim, generator=gen).to(dev, dtype)
    points = []
    for b in batches:
        pos = torch.randint(min(100, seq - 1), seq, (b,), generator=gen).to(dev)
        q = torch.randn(b, heads, dim, generator=gen).to(dev, dtype)
        kv_bytes = int((pos + 1).sum()) * kv_heads * dim * 2 * k.element_size()
        points.append((b, q, pos, kv_bytes))
    rows = []
    for config in configs:
        row: dict = {"config": list(config), "us": {}, "gb_per_s": {}}
        try:
            for b, q, pos, kv_bytes in points:
                want = decode_attention(q, k, v, pos, config=DEFAULT_KERNEL).float()
                got = decode_attention(q, k, v, pos, config=config).float()
                if (got - want).abs().max().item() > 2e-2:
                    raise AssertionError("output differs from the default config")
                us = timed_us(
                    lambda q=q, pos=pos, c=config: decode_attention(q, k, v, pos, config=c), dev, args.repeats
                )
                row["us"][b], row["gb_per_s"][b] = round(us, 1), round(kv_bytes / us / 1e3, 1)
            row["total_us"] = round(sum(row["us"].values()), 1)
        except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory) is skipped
            row["error"] = repr(exc)[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = [r for r in rows if "total_us" in r]
    best = min(ok, key=lambda r: r["total_us"])
    result = {"gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else None, "batches": batches,
              "default": ok[0], "best": best, "speedup_vs_default": round(ok[0]["total_us"] / best["total_us"], 3),
              "best_env": "AGENTRL_DECODE_KERNEL=" + ",".join(map(str, best["config"]))}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_kernel_sweep.json").write_text(json.dumps({**result, "all": rows}) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
