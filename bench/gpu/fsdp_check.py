"""FSDP2 torch learner (learner.fsdp) vs the single-GPU torch learner on the Qwen3-0.6B architecture.

GPU:       torchrun --standalone --nproc_per_node 2 bench/gpu/fsdp_check.py --out DIR
CPU smoke: torchrun --standalone --nproc_per_node 2 bench/gpu/fsdp_check.py --device cpu --tiny --out DIR

Rank 0 first trains the plain learner alone (one GPU) for warmup + timed steps and records its first-step loss,
grad norm and log-probs; then every rank runs the FSDP learner from the same random-init HF directory on the same
batch (8 x 2048 tokens, bf16 compute, fp32 master weights). `ok` = the first FSDP step matches the single-device
step (bf16 tolerance on GPU, 1e-4 on CPU fp32) and a save/load round trip restores the weights exactly. One JSON
line (also DIR/fsdp_check.json): step time, tokens/s and peak memory per GPU of both, and their ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from bench.learner_workload import ensure_model_dir, fill_defaults, make_batch, sync


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU smoke test)")
    p.add_argument("--batch", type=int, default=0, help="sequences per step (default 8; tiny 4)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default 2048; tiny 64)")
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="default 4096; tiny 64")
    p.add_argument("--steps", type=int, default=0, help="timed steps (default 5; tiny 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--model-dir", default="")
    p.add_argument("--out", default="", help="write fsdp_check.json here")
    args = fill_defaults(p.parse_args(argv), steps=(2, 5))
    args.micro_batch_tokens = args.micro_batch_tokens or (64 if args.tiny else 4096)
    return args


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0


def run(args, path: Path, fsdp: bool) -> dict:
    """First-step metrics and log-probs, then mean step time over the timed steps (after warmup)."""
    from agentrl.config.learning import AlgorithmSection, LearnerSection
    from agentrl.learners.torch_learner import TorchLearner

    cfg = LearnerSection(device=args.device, dtype=args.dtype, lr=1e-5, micro_batch_tokens=args.micro_batch_tokens,
                         fsdp=fsdp, gradient_checkpointing=args.gradient_checkpointing)  # fmt: skip
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    learner = TorchLearner(path, cfg, AlgorithmSection(off_policy="none"))
    batch = make_batch(args, args.device)
    logprobs = learner.compute_logprobs(batch).cpu()
    first = learner.train_step(batch)
    for _ in range(args.warmup):
        learner.train_step(batch)
    sync(args.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        learner.train_step(batch)
    sync(args.device)
    step_s = (time.perf_counter() - start) / args.steps
    out = {"step_s": step_s, "tokens_per_s": batch.n_tokens / step_s, "peak_gib": peak_gib(args.device),
           "loss0": first["loss"], "grad_norm0": first["grad_norm"], "logprobs": logprobs, "learner": learner}  # fmt: skip
    return out


def round_trip(learner, path: Path) -> float:
    """Max |weight difference| after save -> load into a fresh FSDP learner (0 when exact)."""
    from agentrl.learners.torch_learner import TorchLearner

    ckpt = Path(tempfile.gettempdir()) / "agentrl-fsdp-check-ckpt"
    learner.save(str(ckpt))
    resumed = TorchLearner(path, learner.cfg, learner.algo)
    resumed.load(str(ckpt))
    diff = 0.0
    for (_, a), (_, b) in zip(learner.weights(), resumed.weights(), strict=True):
        diff = max(diff, float((a.float() - b.float()).abs().max()))
    assert (resumed.step, resumed.policy_version) == (learner.step, learner.policy_version)
    return diff


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = ensure_model_dir(args)
    single = None
    if rank == 0:
        single = run(args, path, fsdp=False)
        del single["learner"]
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    sharded = run(args, path, fsdp=True)
    roundtrip_diff = round_trip(sharded.pop("learner"), path)
    peaks = [None] * world
    dist.all_gather_object(peaks, sharded["peak_gib"])
    if rank == 0:
        bf16 = args.dtype == "bfloat16"
        tol = 2e-2 if bf16 else 1e-4
        logp_diff = float((sharded.pop("logprobs") - single.pop("logprobs")).abs().mean())
        loss_diff = abs(sharded["loss0"] - single["loss0"])
        norm_rel = abs(sharded["grad_norm0"] - single["grad_norm0"]) / max(single["grad_norm0"], 1e-12)
        ok = logp_diff <= tol and loss_diff <= tol * max(1.0, abs(single["loss0"])) and norm_rel <= 5 * tol
        result = {
            "ok": bool(ok and roundtrip_diff == 0.0), "world": world, "device": args.device, "dtype": args.dtype,
            "tokens_per_step": args.batch * args.seq, "micro_batch_tokens": args.micro_batch_tokens,
            "single": single, "fsdp": {**sharded, "peak_gib_per_rank": peaks},
            "logprob_mean_abs_diff": logp_diff, "loss0_abs_diff": loss_diff, "grad_norm0_rel_diff": norm_rel,
            "roundtrip_max_diff": roundtrip_diff,
            "speedup_vs_single": single["step_s"] / sharded["step_s"],
            "peak_mem_ratio_vs_single": max(peaks) / single["peak_gib"] if single["peak_gib"] else None,
        }  # fmt: skip
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "fsdp_check.json").write_text(line + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
