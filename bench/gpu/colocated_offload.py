"""Colocated memory hand-off on one GPU: the torch learner + real SGLang, with and without `run.offload`.

    python3 bench/gpu/colocated_offload.py --arch qwen3-4b --offload --out $OUT [--steps 4]
    python3 bench/gpu/colocated_offload.py --arch qwen3-4b --no-offload --out $OUT
    python3 bench/gpu/colocated_offload.py --arch qwen3-8b --lora --offload --out $OUT     # LoRA, >= 8B
    python3 bench/gpu/colocated_offload.py --arch tiny --engine embedded --device cpu --lora --steps 2 \
        --prompts 2 --samples 2 --prompt-len 8 --new-tokens 4                             # CPU smoke, no SGLang

The pieces `agentrl run --run.placement colocated --run.offload true` puts in one process, without Ray or a
tokenizer: a random-init Qwen3 architecture, the torch learner (bf16 autocast, gradient checkpointing), an SGLang
server on the same GPU (with offload: `--enable-memory-saver --enable-weights-cpu-backup`) and agentrl's `HandOff`.
Each step: rollout (8 prompts x 8 samples, random 128-token prompts, 256 new tokens, temperature 1), GRPO train
step, publish. Full fine-tuning: fp32 weights + AdamW (16 bytes a parameter), published with
`update_weights_from_tensor` (CUDA IPC). `--lora` (`[learner.lora]` rank 16, alpha 32, all-linear): the base is
frozen and out of the optimizer but stays fp32 (the torch learner loads every weight in fp32 and autocasts: 4
bytes a base parameter, 32.8 GB for Qwen3-8B, which the hand-off moves to pinned CPU memory with the rest); a
publish is the adapter alone, written as a PEFT directory and loaded by SGLang under a versioned name
(`/load_lora_adapter agentrl-v<N>`, SGLang launched with `lora_server_args`, as bench/gpu/sglang_lora_check.py).
B is drawn at random (std 0.05, as that check) so the adapter moves the log-probs: on the first step the learner
scores the sampled tokens with and without its adapter (`served_vs_learner`, `served_vs_base`), which shows
that SGLang served base + adapter after the memory release and resume (SGLang 0.5.12 keeps loaded adapters in
CPU memory and its LoRA buffers outside the memory saver's regions; the base comes back from the CPU backup).
Without offload the learner stays on the GPU next to SGLang; an out-of-memory error (SGLang refusing to start,
or CUDA OOM) is recorded as the result. Prints one JSON line per step and a summary line {"arch", "offload",
"lora_rank", "ok", "oom", "step_s_median", peaks, publish bytes and seconds}; appends the result to
$OUT/colocated_offload.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_bench  # noqa: E402
import torch  # noqa: E402

from agentrl import types  # noqa: E402
from agentrl.actors.colocated import allocator_settings  # noqa: E402
from agentrl.actors.handoff import HandOff, PeakMeter  # noqa: E402
from agentrl.config.learning import AlgorithmSection, LearnerSection, LoraSection  # noqa: E402
from agentrl.engines.base import AdapterSource, SamplingParams, TensorSource  # noqa: E402
from agentrl.engines.embedded import EmbeddedEngine  # noqa: E402
from agentrl.engines.sglang import SGLangEngine  # noqa: E402
from agentrl.engines.sglang_launcher import SGLangServer, lora_server_args  # noqa: E402
from agentrl.learners.batch import Batch, build_batch  # noqa: E402
from agentrl.learners.torch_learner import TorchLearner  # noqa: E402

engine_bench.ARCHS.update({  # Qwen3-1.7B / Qwen3-4B shapes (random weights); qwen3-8b is engine_bench's own
    "qwen3-1.7b": dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
                       vocab=151936, tie=True),
    "qwen3-4b": dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728,
                     vocab=151936, tie=True),
})  # fmt: skip
SGLANG_FLAGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
                "disable_piecewise_cuda_graph": True, "skip_server_warmup": True, "skip_tokenizer_init": True,
                "dtype": "bfloat16"}  # fmt: skip
# sglang_lora_check.py's B: |B·A·x| comparable to the base's outputs, a clearly different policy
LORA_B_STD = 0.05
STARTED = time.monotonic()


def is_oom(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "not enough memory" in text


async def rollout(engine, vocab: int, version: int, step: int, args) -> list[types.Trajectory]:
    g = torch.Generator().manual_seed(step)
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    prompts = [torch.randint(vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    outs = await asyncio.gather(*(engine.generate(p, sp) for p in prompts for _ in range(args.samples)))
    trajs = []
    for i, out in enumerate(outs):
        t = types.Trajectory(id=f"{step}-{i}", group_id=f"{step}-{i // args.samples}",
                             prompt_ids=prompts[i // args.samples], response_ids=out.output_ids,
                             logprobs=types.pack_floats(out.logprobs),
                             reward=float(torch.rand((), generator=g)), policy_version=version)  # fmt: skip
        trajs.append(types.normalize(t))
    return trajs


def make_learner(args, path: Path) -> TorchLearner:
    lora = LoraSection(rank=args.lora_rank, alpha=2.0 * args.lora_rank, target_modules=["all-linear"])
    lc = LearnerSection(device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32", lr=1e-6, gradient_checkpointing=True,
                        micro_batch_tokens=args.micro_batch_tokens,
                        lora=lora if args.lora else LoraSection())  # fmt: skip
    learner = TorchLearner(path, lc, AlgorithmSection(advantage="grpo"))
    if learner.lora is not None:
        gen = torch.Generator(device=learner.device).manual_seed(0)
        with torch.no_grad():
            for name, p in learner.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * LORA_B_STD)
    return learner


def make_server(args, path: Path, learner: TorchLearner) -> SGLangServer | None:
    if args.engine != "sglang":
        return None
    flags = {
        **(lora_server_args(learner.lora) if learner.lora is not None else {}),
        **SGLANG_FLAGS,
        "mem_fraction_static": args.mem_fraction,
        "enable_memory_saver": args.offload,
        "enable_weights_cpu_backup": args.offload,
    }  # as agentrl.actors.engine launches it with run.offload (and learner.lora)
    return SGLangServer(str(path), args=flags, log_path=str(_log_path(args)), startup_timeout_s=600,
                        restart_on_crash=False)  # fmt: skip


def _log_path(args) -> Path:
    return Path(args.out) / f"sglang_{args.arch}{'_lora' if args.lora else ''}_{args.offload}.log"


class Publisher:
    """One publish, as `agentrl run` sends it: full weights as tensors, or under LoRA the adapter alone as a PEFT
    directory the engine loads by versioned name (the last two directories kept). `last`: its bytes and times."""

    def __init__(self, learner: TorchLearner, engine, root: Path):
        self.learner, self.engine, self.root = learner, engine, root
        shutil.rmtree(root, ignore_errors=True)
        self.last: dict[str, float] = {}

    async def __call__(self, version: int) -> None:
        t0 = time.perf_counter()
        if self.learner.lora is None:
            tensors = dict(self.learner.weights())
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            source = TensorSource(tensors)
        else:
            path = self.root / f"v{version}"
            await asyncio.to_thread(self.learner.save_adapter_dir, str(path))
            size = sum(f.stat().st_size for f in path.iterdir() if f.name.endswith(".safetensors"))
            source = AdapterSource(str(path))
        t1 = time.perf_counter()
        await self.engine.update_weights(version, source)
        shutil.rmtree(self.root / f"v{version - 2}", ignore_errors=True)
        self.last = {"publish_mb": round(size / 1e6, 2), "publish_save_s": round(t1 - t0, 3),
                     "publish_load_s": round(time.perf_counter() - t1, 3)}  # fmt: skip


@torch.no_grad()
def served_check(learner: TorchLearner, batch: Batch) -> dict:
    """The engine's log-probs of its sampled tokens against the learner's with the adapter just published and
    without it (the base): base + adapter served gives bf16 noise in the first and the adapter's effect in the
    second."""
    mask = batch.loss_mask.to(learner.device) > 0
    served = batch.rollout_logprobs.to(learner.device)[mask]
    adapted = learner.compute_logprobs(batch)[mask]
    with learner.model.disable_adapter():
        base = learner.compute_logprobs(batch)[mask]
    vs_learner, vs_base = float((served - adapted).abs().mean()), float((served - base).abs().mean())
    return {"served_vs_learner": _sig(vs_learner), "served_vs_base": _sig(vs_base),
            "adapter_served": vs_base > 3 * vs_learner}  # fmt: skip


def _sig(x: float) -> float:
    return float(f"{x:.3g}")


async def train_phase(args, learner, handoff, meter, trajs, step: int) -> tuple[dict, dict]:
    """(train stats + the served check on step 0 under LoRA, this step's memory metrics)."""
    if handoff:
        await handoff.to_training()
    rollout_peak = None if handoff else meter.take()
    batch = build_batch(trajs, learner.pad_id, args.device)
    check = (
        await asyncio.to_thread(served_check, learner, batch)
        if learner.lora is not None and step == 0
        else {}
    )
    stats = await asyncio.to_thread(learner.train_step, batch)
    mem = handoff.train_metrics() if handoff else {"memory/rollout_peak_gib": rollout_peak,
                                                    "memory/train_peak_gib": meter.take()}  # fmt: skip
    mismatch = stats.get("logprob_mismatch")  # mean |learner - engine| log-prob of the sampled tokens
    return {
        **check,
        "loss": stats["loss"],
        "logprob_mismatch": None if mismatch is None else _sig(mismatch),
    }, mem


def out_of_time(args, last_step_s: float) -> bool:
    """Would one more step (the last one's time, +30%) end past --time-limit-s (counted from the start)?"""
    if not args.time_limit_s:
        return False
    return time.monotonic() - STARTED + 1.3 * last_step_s > args.time_limit_s


async def steps(args, learner, engine, result: dict, progress: dict) -> None:
    meter = PeakMeter()
    handoff = HandOff(learner, [engine], meter) if args.offload else None
    publisher = Publisher(learner, engine, Path(args.workdir) / f"adapters_{args.arch}_{args.offload}")
    version = 0

    async def publish():
        update = lambda: publisher(version)  # noqa: E731
        return await (handoff.publish(update) if handoff else update())

    try:
        progress["phase"] = "first publish"
        await publish()
        for step in range(args.steps):
            if result["steps"] and out_of_time(args, result["steps"][-1]["step_s"]):
                result["steps_cut_at"] = step  # the summary still gets written inside the case's timeout
                break
            t0 = time.perf_counter()
            progress["phase"] = "rollout"
            trajs = await rollout(engine, learner.model.config.vocab_size, version, step, args)
            t1 = time.perf_counter()
            progress["phase"] = "train"
            stats, mem = await train_phase(args, learner, handoff, meter, trajs, step)
            t2 = time.perf_counter()
            progress["phase"] = "publish"
            version = learner.policy_version
            await publish()
            t3 = time.perf_counter()
            if args.device == "cuda":  # the learner's own GPU memory after the publish (0 when all offloaded)
                stats["learner_gib_after_publish"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            row = {"step": step, "rollout_s": round(t1 - t0, 2), "train_s": round(t2 - t1, 2),
                   "publish_s": round(t3 - t2, 2), "step_s": round(t3 - t0, 2), **stats, **publisher.last,
                   **{k: round(v, 2) for k, v in mem.items() if v is not None}}  # fmt: skip
            result["steps"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        (handoff or meter).close()


async def run(args) -> dict:
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / args.arch
    if not (path / "config.json").exists():
        engine_bench.build_model(args.arch, root, "bfloat16", args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    result: dict = {"arch": args.arch, "engine": args.engine, "offload": args.offload,
                    "lora_rank": args.lora_rank if args.lora else 0, "ok": False, "oom": False, "steps": []}  # fmt: skip
    learner = make_learner(args, path)
    result["learner_params_b"] = round(sum(p.numel() for p in learner.model.parameters()) / 1e9, 3)
    result["trainable_params_m"] = round(
        sum(p.numel() for p in learner.optimizer.param_groups[0]["params"]) / 1e6, 2
    )
    result["base_dtype"] = str(next(learner.model.parameters()).dtype).removeprefix("torch.")
    if args.offload:
        learner.offload()
    server = make_server(args, path, learner)
    engine, progress = None, {"phase": "engine start"}
    # `timeout` ending the case cancels this task: SGLang (its own process group) is stopped, the summary written
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    try:
        if server is not None:
            await asyncio.to_thread(server.start)
            engine = SGLangEngine(server.url, update_timeout_s=600, request_timeout_s=600)
        else:
            engine = EmbeddedEngine(str(path), device=args.device, max_batch_size=args.prompts * args.samples,
                                    dtype="bfloat16" if args.device == "cuda" else "float32",
                                    max_seq_len=args.prompt_len + args.new_tokens)  # fmt: skip
        await steps(args, learner, engine, result, progress)
        result["ok"] = True
    except asyncio.CancelledError:
        result.update(timed_out=True, failed_in=progress["phase"])
    except Exception as exc:  # the no-offload case of a model that does not fit is expected to end here
        result.update(
            oom=is_oom(exc), failed_in=progress["phase"], error=f"{type(exc).__name__}: {str(exc)[-400:]}"
        )
        log = _log_path(args)
        if not result["oom"] and log.exists():
            tail = log.read_text()[-3000:].lower()
            result["oom"] = "out of memory" in tail or "not enough memory" in tail
    finally:
        if engine is not None:
            await engine.close()
        if server is not None:
            await asyncio.to_thread(server.stop)
    summarize(result)
    return result


def summarize(result: dict) -> None:
    rows = result["steps"]
    timed = rows[1:] or rows  # the first step pays one-time costs (allocator warm-up, the served check)
    if not timed:
        return
    result["step_s_median"] = statistics.median(s["step_s"] for s in timed)
    result["step_s_range"] = [min(s["step_s"] for s in timed), max(s["step_s"] for s in timed)]
    for key in ("memory/rollout_peak_gib", "memory/train_peak_gib", "memory/publish_peak_gib"):
        values = [s[key] for s in rows if key in s]
        if values:
            result[key.replace("memory/", "max_")] = max(values)
    result["publish_mb"] = rows[-1]["publish_mb"]
    for key in ("publish_s", "publish_save_s", "publish_load_s"):
        result[f"{key}_median"] = statistics.median(s[key] for s in timed)
    mismatch = [s["logprob_mismatch"] for s in rows if s.get("logprob_mismatch") is not None]
    if mismatch:
        result["logprob_mismatch_max"] = _sig(max(mismatch))
    for key in ("served_vs_learner", "served_vs_base", "adapter_served"):
        if key in rows[0]:
            result[key] = rows[0][key]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3-4b", choices=sorted([*engine_bench.ARCHS, "tiny"]))
    ap.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter (all-linear, alpha = 2 x rank)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--engine", choices=["sglang", "embedded"], default="sglang")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (one GRPO group)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mem-fraction", type=float, default=0.35, help="SGLang --mem-fraction-static")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument(
        "--expandable-segments",
        action="store_true",
        help="the learner's allocator maps segments on demand (this process only, not SGLang's): "
        "a 4B full fine-tune's step 1 ran 4 GiB of cached-but-free blocks short on 80 GB",
    )
    ap.add_argument("--time-limit-s", type=float, default=0.0,
                    help="start no step that would end past this many seconds from the start (0: no limit)")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/colocated_offload"))
    ap.add_argument("--workdir", default="/tmp/agentrl_colocated_offload")
    args = ap.parse_args(argv)
    if args.device == "cpu" and args.engine == "sglang":
        ap.error("--device cpu needs --engine embedded (SGLang runs on a GPU)")
    if args.lora and args.lora_rank < 1:
        ap.error(f"--lora-rank must be >= 1 with --lora, got {args.lora_rank}")
    for flag in ("steps", "prompts", "samples", "prompt_len", "new_tokens"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.expandable_segments and args.device == "cuda":
        # (what ColocatedHost does for run.offload with SGLang)
        allocator_settings("expandable_segments:True")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args))
    summary = {k: v for k, v in result.items() if k != "steps"}
    with open(Path(args.out) / "colocated_offload.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
