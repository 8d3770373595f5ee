"""Publish bandwidth: learner on GPU 0 broadcasts the model to an engine on GPU 1.

    python3 bench/gpu/nccl_publish_bench.py --server sglang --out $OUT            # 2 GPUs, real SGLang on GPU 1
    python3 bench/gpu/nccl_publish_bench.py --server embedded --out $OUT          # agentrl serve-engine on GPU 1
    python3 bench/gpu/nccl_publish_bench.py --device cpu --backend gloo --arch tiny   # CPU smoke test

The learner (this process, HF model on GPU 0) joins the engine's `/init_weights_update_group` (NCCL), then
publishes the whole model `--repeats` times per bucket size: `0` = one broadcast per tensor, otherwise
flattened uint8 buckets of at most that many MiB (SGLang's `load_format="flattened_bucket"`). A publish is
timed from the first broadcast to the engine's answer for the last bucket (received and loaded). The limit is
measured in the same script: one plain `torch.distributed.broadcast` of a flat buffer of the same size from
this process to a helper process on the engine's GPU. Prints one JSON line; `ratio` = limit time / publish
time (1.0 = publishing costs no more than the raw transfer); `fixed_call_s` is one update call carrying only
the smallest tensor (the engine's per-call cost; `calls` per publish). Set NCCL_NVLS_ENABLE=0 (bench/gpu/common.sh does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_launcher import SGLangServer
from agentrl.engines.weight_sync import (
    broadcast_tensor,
    describe,
    init_weights_update_group,
    plan_buckets,
    send_broadcast,
    send_bucket,
)
from agentrl.net import free_port

SGLANG_FLAGS = {
    "attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
    "disable_piecewise_cuda_graph": True, "skip_server_warmup": True, "skip_tokenizer_init": True,
    "disable_cuda_graph": True, "mem_fraction_static": 0.5,
}  # fmt: skip


def build_model(arch: str, root: Path, device: str) -> Path:
    if arch == "tiny":
        from agentrl.engines.tiny import make_tiny_model

        return make_tiny_model(root / "tiny", arch="qwen3", seed=0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from engine_bench import build_model as bench_build

    return bench_build(arch, root, "bfloat16" if device.startswith("cuda") else "float32", device)


def _receiver(port: int, nbytes: int, backend: str, device: str, repeats: int) -> None:
    """Helper process on the engine's GPU for the plain-broadcast limit."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    group = init_weights_update_group("127.0.0.1", port, 1, 2, backend=backend, group_name="limit")
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device if backend == "nccl" else "cpu")
    for _ in range(repeats + 1):
        broadcast_tensor(group, buf)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_limit(nbytes: int, args) -> dict:
    port = free_port()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_receiver, args=(port, nbytes, args.backend, args.engine_device, args.repeats))
    proc.start()
    group = init_weights_update_group("127.0.0.1", port, 0, 2, backend=args.backend, group_name="limit")
    buf = torch.ones(nbytes, dtype=torch.uint8, device=args.device)
    times = []
    for i in range(args.repeats + 1):  # the first one sets up the communicator
        _sync(args.device)
        start = time.perf_counter()
        broadcast_tensor(group, buf)
        _sync(args.device)
        if i:
            times.append(time.perf_counter() - start)
    proc.join(60)
    best = min(times)
    return {
        "seconds": round(best, 4),
        "gb_per_s": round(nbytes / 1e9 / best, 2),
        "all_s": [round(t, 4) for t in times],
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def start_server(path: Path, args) -> tuple[str, object]:
    env = dict(os.environ)
    if args.server == "sglang":
        gpu = args.engine_device.split(":")[-1]
        server = SGLangServer(str(path), args=SGLANG_FLAGS, env={"CUDA_VISIBLE_DEVICES": gpu},
                              log_path=str(Path(args.out) / "publish_server.log"), startup_timeout_s=600,
                              restart_on_crash=False)  # fmt: skip
        server.start()
        return server.url, server.stop
    dtype = "bfloat16" if args.engine_device.startswith("cuda") else "float32"
    cmd = [sys.executable, "-c", "import sys; from agentrl.cli import main; sys.exit(main(sys.argv[1:]))",
           "serve-engine", "--model", str(path), "--port", "0", "--device", args.engine_device, "--dtype", dtype,
           "--max-batch-size", "4", "--max-seq-len", "256"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        if "serving http" in line:
            url = line.strip().rsplit(" ", 1)[-1]
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return url, proc.terminate
    raise SystemExit(f"serve-engine exited with {proc.wait()}")


async def publish_all(engine: SGLangEngine, group, named, bucket_mb: int, version: int) -> float:
    start = time.perf_counter()
    if bucket_mb == 0:
        meta = describe(group.name, named)
        await asyncio.gather(
            asyncio.to_thread(send_broadcast, group, named), engine.update_weights(version, meta)
        )
    else:
        for bucket in plan_buckets(named, bucket_mb << 20):
            meta = describe(group.name, bucket, load_format="flattened_bucket")
            await asyncio.gather(
                asyncio.to_thread(send_bucket, group, bucket), engine.update_weights(version, meta)
            )
    # the broadcasts are queued on the stream: the publish ends when they have completed
    _sync(str(named[0][1].device))
    return time.perf_counter() - start


async def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = build_model(args.arch, Path(args.workdir), args.device)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    named = [(n, p.detach()) for n, p in learner.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    result: dict = {"gb": round(nbytes / 1e9, 3), "tensors": len(named), "server": args.server,
                    "backend": args.backend, "limit": measure_limit(nbytes, args), "publish": []}  # fmt: skip
    url, stop = await asyncio.to_thread(start_server, path, args)
    engine = SGLangEngine(url, update_timeout_s=600)
    try:
        port = free_port()
        holder: dict = {}
        thread = threading.Thread(
            target=lambda: holder.setdefault(
                "g",
                init_weights_update_group(
                    "127.0.0.1", port, 0, 2, backend=args.backend, group_name="publish"
                ),
            )
        )
        thread.start()
        await engine.init_weights_update_group("127.0.0.1", port, 1, 2, "publish", args.backend)
        thread.join()
        group, version = holder["g"], 0
        # the engine's fixed cost per update call: one tiny tensor (HTTP, scheduler, load of one parameter)
        smallest = [min(named, key=lambda item: item[1].numel())]
        fixed = []
        for _ in range(args.repeats + 1):
            version += 1
            fixed.append(await publish_all(engine, group, smallest, 0, version))
        result["fixed_call_s"] = round(min(fixed[1:]), 4)
        for bucket_mb in [int(x) for x in args.buckets_mb.split(",")]:
            times = []
            for _ in range(args.repeats):
                version += 1
                times.append(await publish_all(engine, group, named, bucket_mb, version))
            best = min(times)
            row = {"bucket_mb": bucket_mb, "seconds": round(best, 4), "gb_per_s": round(nbytes / 1e9 / best, 2),
                   "ratio_to_limit": round(result["limit"]["seconds"] / best, 3),
                   "calls": 1 if bucket_mb == 0 else len(plan_buckets(named, bucket_mb << 20)),
                   "all_s": [round(t, 4) for t in times]}  # fmt: skip
            result["publish"].append(row)
            print(json.dumps(row), flush=True)
        info = await engine.health()
        result["engine_policy_version"] = info.get("policy_version")
    finally:
        await engine.close()
        stop()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=["sglang", "embedded"], default="sglang")
    ap.add_argument("--arch", choices=["qwen3-0.6b", "qwen3-8b", "tiny"], default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda:0", help="learner device")
    ap.add_argument("--engine-device", default=None, help="default: cuda:1 (cpu with --device cpu)")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    ap.add_argument("--buckets-mb", default="0,64,256,1024,4096", help="0 = one broadcast per tensor")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/agentrl_publish_bench")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/publish_bench"))
    args = ap.parse_args()
    args.engine_device = args.engine_device or ("cpu" if args.device == "cpu" else "cuda:1")
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    result = asyncio.run(run(args))
    line = json.dumps(result)
    (Path(args.out) / "nccl_publish_bench.json").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
