"""Megatron learner throughput and MFU vs Hugging Face + torch AdamW, on the Qwen3-0.6B architecture.

One GPU:   python bench/megatron_bench.py            (hf, megatron, megatron_compile; 8 x 2048 tokens/step)
TP = 2:    torchrun --nproc_per_node 2 bench/megatron_bench.py --tp 2 --variants megatron,megatron_compile
DP = 2:    torchrun --nproc_per_node 2 bench/megatron_bench.py --variants megatron
MoE, EP=2: python bench/megatron_bench.py --model qwen3-30b-a3b-4l --variants hf   (the one-GPU baseline), then
           torchrun --nproc_per_node 2 bench/megatron_bench.py --model qwen3-30b-a3b-4l --ep 2 --variants megatron
           (MoE variant suffixes: `_seq` megatron's SequentialMLP experts instead of the grouped matmul
           (learner.moe_experts), `_a2a` the alltoall token dispatcher instead of allgather
           (learner.moe_token_dispatcher): megatron_seq, megatron_a2a, megatron_compile_a2a, ...)
CPU smoke: python bench/megatron_bench.py --device cpu --tiny   (--tiny --model qwen3-30b-a3b-4l: a tiny MoE)

Random-init weights (written once as an HF directory), bf16 on GPU. A step is one optimizer step over the whole
batch (forward + backward + update); `step_s` is the median of the timed steps (each ends with the step's read
of its metrics, so the host waits for the GPU in every one). `mfu` counts FLOPs per token = 6 N + 6 L H d S:
N = all parameters (tied embedding counted once, so the LM head's matmul is in 6 N), and causal attention's
scores and values (fwd + bwd) at half of the full S x S (12 L H d S / 2: a causal kernel skips the upper
triangle). A mixture of experts (the `MOE_ARCHS` of bench/engine_bench.py, with `--ep` the Megatron learner's
expert parallelism) counts its ACTIVE parameters as N: per MoE layer the router and top-k experts (plus shared
experts), dense layers whole, the LM head (untied; the input embedding is a lookup, no FLOPs).
`mfu_full_attention` counts the full 12 L H d S (PaLM's convention, what earlier docs reported); `mfu_6n` 6 N
alone. Peak 989e12 FLOP/s (H100/H200 bf16 dense) per GPU. Run-to-run spread is large (host time between
kernels varies): bench/learner_mfu.py runs this script several times and reports medians.
Each variant runs in its own try block: a failure is reported (with its traceback) and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # learner_workload, also when imported as bench.megatron_bench

import torch
from learner_workload import MODELS, MOE_ARCHS, ensure_model_dir, fill_defaults, log, make_batch, sync

PEAK_FLOPS = 989e12


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU smoke test)")
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS) + sorted(MOE_ARCHS),
                   help="architecture (random init)")  # fmt: skip
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (launch with torchrun)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size (launch with torchrun)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size of an MoE --model (torchrun)")
    p.add_argument("--variants", default="hf,megatron,megatron_compile",
                   help="comma list of hf, megatron (eager), megatron_compile (torch.compile), megatron_default "
                        "(learner.compile at its default, as `agentrl run` makes it), torch_learner; a "
                        "'_unfused' suffix (megatron_compile_unfused) runs with AGENTRL_FUSED_LOGPROBS=0, a "
                        "'_fallback' suffix with megatron-core's own fallback optimizer ops instead of "
                        "agentrl's (learners/megatron/host_overhead.py), a '_graphs' suffix compiles with "
                        "mode='reduce-overhead' (CUDA graphs)")  # fmt: skip
    p.add_argument(
        "--profile", action="store_true", help="print the top CUDA kernels of one step per variant"
    )
    p.add_argument("--batch", type=int, default=0, help="sequences per step (default 8; tiny 4)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default 2048; tiny 64)")
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="default: the whole per-DP-rank batch")
    p.add_argument("--steps", type=int, default=0, help="timed steps (default 8; tiny 3)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="timed blocks of --steps steps per variant: step_s is the median of the blocks' medians "
                        "(step_s_blocks lists them)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="skip the variants left once this many seconds have passed (0 = no limit): a run cut "
                        "short by its caller's timeout still ends cleanly with the results it has")  # fmt: skip
    p.add_argument("--hf-chunks", type=int, default=1, help="gradient-accumulation chunks of the HF baseline")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "local"])
    p.add_argument("--model-dir", default="", help="where the random HF model is written (default /tmp/...)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    return fill_defaults(p.parse_args(argv), steps=(3, 8))


def n_params(dims: dict) -> int:
    """All parameters (a dense model's, tied embedding once); an MoE model's active ones (module docstring)."""
    h, hd, ffn, v = dims["hidden"], dims["head_dim"], dims["ffn"], dims["vocab"]
    q, kv = dims["heads"] * hd, dims["kv_heads"] * hd
    attention = h * (q + 2 * kv) + q * h + 2 * h + 2 * hd
    if "experts" not in dims:
        return v * h + dims["layers"] * (attention + 3 * h * ffn) + h
    moe = h * dims["experts"] + (dims["topk"] + dims["shared"]) * 3 * h * dims["moe_ffn"]
    dense = dims["dense_layers"]
    return v * h + dims["layers"] * attention + dense * 3 * h * ffn + (dims["layers"] - dense) * moe + h


def n_params_total(dims: dict) -> int:
    """Every parameter (an MoE model's experts all counted, its input embedding too)."""
    if "experts" not in dims:
        return n_params(dims)
    h = dims["hidden"]
    idle = (
        (dims["experts"] - dims["topk"]) * 3 * h * dims["moe_ffn"] * (dims["layers"] - dims["dense_layers"])
    )
    return n_params(dims) + idle + dims["vocab"] * h


def flops_per_token(dims: dict, seq: int) -> dict[str, float]:
    """Training FLOPs per token under the three conventions named in the module docstring."""
    six_n = 6.0 * n_params(dims)
    full_attention = 12.0 * dims["layers"] * dims["heads"] * dims["head_dim"] * seq
    return {"mfu": six_n + full_attention / 2, "mfu_full_attention": six_n + full_attention, "mfu_6n": six_n}


def timed(step, args) -> dict:
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync(args.device)
    warmup_s = time.perf_counter() - t0  # with torch.compile: the compile at start
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, blocks = [], []
    for _ in range(max(1, getattr(args, "repeats", 1))):
        block = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = step()  # reads its loss: the host waits for the step's GPU work
            sync(args.device)
            block.append(time.perf_counter() - t0)
        times += block
        blocks.append(statistics.median(block))
    mem = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
    return {"step_s": statistics.median(blocks), "step_s_blocks": [round(t, 4) for t in blocks],
            "step_times_s": [round(t, 4) for t in times], "warmup_s": round(warmup_s, 2),
            "peak_mem_gib": round(mem, 2), "last": out}  # fmt: skip


def profile_step(step) -> None:
    """One step under torch.profiler (rank 0): the step's wall time against the time the GPU was busy (union
    of kernel intervals; the rest is the host between kernels), the kernel count, the host ops with the most
    self CPU time, syncs, and the 15 CUDA kernels with the most total time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    )
    busy_us, cur_start, cur_end, gaps, last_name = 0.0, None, None, [], ""
    for start, end, name in kernels:
        if cur_end is None or start > cur_end:
            busy_us += 0.0 if cur_end is None else cur_end - cur_start
            if cur_end is not None:
                gaps.append((start - cur_end, last_name, name))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
        last_name = name if end >= cur_end else last_name
    busy_us += 0.0 if cur_end is None else cur_end - cur_start
    gaps.sort(reverse=True)
    log(
        f"profile: idle gaps between kernels: {sum(g[0] for g in gaps) / 1e3:.1f} ms in {len(gaps)}; largest:"
    )
    for gap_us, before, after in gaps[:12]:
        log(f"  {gap_us / 1e3:7.2f} ms  after {before[:70]}  before {after[:70]}")
    syncs = [e for e in prof.events() if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item",
                                                     "aten::_local_scalar_dense", "cudaMemcpyAsync")]  # fmt: skip
    log(f"profile: step wall {wall_s * 1e3:.1f} ms (under the profiler), GPU busy {busy_us / 1e3:.1f} ms, "
        f"{len(kernels)} kernels, {len(syncs)} sync/copy calls")  # fmt: skip
    averages = prof.key_averages()
    log(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    log(averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))


def run_hf(args, path: Path) -> dict:
    from transformers import AutoModelForCausalLM

    device = args.device
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    ).to(device)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = make_batch(args, device)
    chunks = batch.input_ids.chunk(args.hf_chunks)

    def step():
        for ids in chunks:  # gradient accumulation only after an out-of-memory retry
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss / len(chunks)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return timed(step, args)


def learner_section(args, kind: str, world: int):
    from agentrl.config.learning import LearnerSection

    dp = world // (args.tp * args.pp)
    mbt = args.micro_batch_tokens or -(-args.batch // dp) * args.seq
    args.micro_batch_tokens = mbt
    mega = kind == "megatron"
    variant = getattr(args, "variant", "")
    moe = dict(moe_experts="sequential" if "_seq" in variant else "grouped",
               moe_token_dispatcher="alltoall" if "_a2a" in variant else "auto") if mega else {}  # fmt: skip
    return LearnerSection(
        kind=kind, device=args.device, dtype=args.dtype, lr=1e-5, grad_clip=1.0, micro_batch_tokens=mbt,
        tensor_parallel=args.tp if mega else 1, pipeline_parallel=args.pp if mega else 1,
        data_parallel=dp if mega else 1, expert_parallel=args.ep if mega else 1, **moe,
    )  # fmt: skip


def run_megatron_default(args, path: Path, world: int) -> dict:
    """The learner as `agentrl run` makes it: learner.compile at its default."""
    from agentrl.config.learning import LearnerSection

    return run_megatron(args, path, world, compile=LearnerSection().compile)


def run_megatron_compile(args, path: Path, world: int) -> dict:
    graphs = "_graphs" in getattr(args, "variant", "")  # CUDA graphs for the compiled forward and backward
    return run_megatron(args, path, world, compile="reduce-overhead" if graphs else True)


def run_megatron(args, path: Path, world: int, compile: bool = False) -> dict:
    fast = "_fallback" not in getattr(args, "variant", "")
    from agentrl.config.learning import AlgorithmSection
    from agentrl.learners.megatron.learner import MegatronLearner

    algo = AlgorithmSection(advantage="grpo", off_policy="none")
    learner = MegatronLearner(
        path, learner_section(args, "megatron", world), algo, attention=args.attention, entropy_metric=False,
        compile=compile, reduce_host_overhead=fast,
    )  # fmt: skip
    batch = make_batch(args, args.device)
    result = timed(lambda: learner.train_step(batch)["loss"], args)
    if args.profile:
        profile_step(lambda: learner.train_step(batch)["loss"])
    t0 = time.perf_counter()
    n = sum(1 for _ in learner.weights())
    sync(args.device)
    result["weights_stream_s"] = round(time.perf_counter() - t0, 3)
    result["weights_tensors"] = n
    return result


def run_torch_learner(args, path: Path) -> dict:
    from agentrl.config.learning import AlgorithmSection
    from agentrl.learners.torch_learner import TorchLearner

    learner = TorchLearner(path, learner_section(args, "torch", 1), AlgorithmSection(off_policy="none"))
    batch = make_batch(args, args.device)
    return timed(lambda: learner.train_step(batch)["loss"], args)


def run_variant(runner, args, path: Path, world: int, single: bool) -> dict:
    """Run one variant; on CUDA out-of-memory retry with half the micro-batch (megatron) or 2x chunks (hf)."""
    saved = args.micro_batch_tokens, args.hf_chunks
    try:
        for retry in range(3):
            try:
                res = runner(args, path) if single else runner(args, path, world)
                res["hf_chunks" if single else "micro_batch_tokens"] = (
                    args.hf_chunks if single else args.micro_batch_tokens
                )
                res["oom_retries"] = retry
                return res
            except torch.OutOfMemoryError:
                if retry == 2 or (not single and args.micro_batch_tokens <= args.seq):
                    raise
                log(f"out of memory, retrying smaller: {traceback.format_exc(limit=1)}")
            # Outside the except block the failed attempt's frames (and its GPU memory) are released.
            args.micro_batch_tokens //= 2
            args.hf_chunks *= 2
            gc.collect()
            torch.cuda.empty_cache()
        raise RuntimeError("unreachable")
    finally:
        args.micro_batch_tokens, args.hf_chunks = saved


def out_of_budget(started: float, args) -> bool:
    """Rank 0's clock decides for every rank (they must run the same variants)."""
    import torch.distributed as dist

    over = torch.tensor([float(time.monotonic() - started > args.budget_s)], device=args.device)
    if dist.is_initialized():
        dist.broadcast(over, src=0)
    return bool(over.item())


def write_summary(args, results: dict, world: int, rank: int, flops: dict) -> None:
    for name in ("megatron", "megatron_compile"):
        if "error" not in results.get("hf", {"error": 1}) and "error" not in results.get(name, {"error": 1}):
            results[f"speedup_{name}_vs_hf"] = results["hf"]["step_s"] / results[name]["step_s"]
    summary = {"world": world, "tp": args.tp, "pp": args.pp, "batch": args.batch, "seq": args.seq,
               "dims": args.dims, "n_params": n_params(args.dims), "n_params_total": n_params_total(args.dims),
               "ep": args.ep, "steps": args.steps, "repeats": args.repeats, "flops_per_token": flops,
               "results": results}  # fmt: skip
    if args.out and rank == 0:
        Path(args.out).write_text(json.dumps(summary, indent=2, default=str) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    from agentrl.learners.megatron.parallel import init_distributed

    torch.set_num_threads(min(8, os.cpu_count() or 1) if args.device == "cuda" else 2)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    init_distributed(args.device)
    world, rank = dist.get_world_size(), dist.get_rank()
    log(
        f"torch {torch.__version__}, world {world}, tp {args.tp}, pp {args.pp}, device {args.device}, dims {args.dims}"
    )
    if args.device == "cuda":
        log(f"gpu: {torch.cuda.get_device_name()}")
    path = ensure_model_dir(args)
    tokens = args.batch * args.seq
    flops = flops_per_token(args.dims, args.seq)
    results = {}
    runners = {
        "hf": run_hf, "megatron": run_megatron, "megatron_compile": run_megatron_compile,
        "megatron_default": run_megatron_default,
        "torch_learner": run_torch_learner,
    }  # fmt: skip
    started = time.monotonic()
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        single = not name.startswith("megatron")
        args.variant = name
        if args.budget_s and out_of_budget(started, args):
            results[name] = {"error": f"skipped: past --budget-s {args.budget_s:g}"}
            log(f"[{name}] skipped: {time.monotonic() - started:.0f} s passed, --budget-s {args.budget_s:g}")
            continue
        os.environ["AGENTRL_FUSED_LOGPROBS"] = "0" if "_unfused" in name else "1"
        if single and world > 1:
            log(f"[{name}] skipped: single-GPU baseline (run it without torchrun)")
            continue
        try:
            base = name
            for suffix in ("_unfused", "_fallback", "_graphs", "_seq", "_a2a"):
                base = base.replace(suffix, "")
            res = run_variant(
                runners[base],
                args,
                path,
                world,
                single,
            )
        except Exception as exc:  # a failing variant must not hide the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"[{name}] FAILED on rank {rank}:\n{traceback.format_exc()}")
            continue
        finally:
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        gpus = world if not single else 1
        res["tokens_per_s"] = tokens / res["step_s"]
        if args.device == "cuda":
            for key, per_token in flops.items():
                res[key] = per_token * res["tokens_per_s"] / (PEAK_FLOPS * gpus)
        results[name] = res
        log(
            f"[{name}] " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()})
        )
        write_summary(
            args, results, world, rank, flops
        )  # after every variant: a run cut short keeps its results
    for name in ("megatron", "megatron_compile"):
        if "error" not in results.get("hf", {"error": 1}) and "error" not in results.get(name, {"error": 1}):
            log(f"{name} / hf throughput: {results['hf']['step_s'] / results[name]['step_s']:.2f}x")
    write_summary(args, results, world, rank, flops)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
