"""Colocated memory hand-off on one GPU (issue 19): full fine-tune + real SGLang, with and without `run.offload`.

    python3 bench/gpu/colocated_offload.py --arch qwen3-4b --offload --out $OUT [--steps 4]
    python3 bench/gpu/colocated_offload.py --arch qwen3-4b --no-offload --out $OUT

The pieces `agentrl run --run.placement colocated --run.offload true` puts in one process, without Ray or a
tokenizer: a random-init Qwen3 architecture, the torch learner (fp32 weights + AdamW: 16 bytes a parameter,
bf16 autocast, gradient checkpointing), an SGLang server on the same GPU (with offload: `--enable-memory-saver
--enable-weights-cpu-backup`)
and agentrl's `HandOff`. Each step: rollout (8 prompts x 8 samples, random 128-token prompts, 256 new tokens,
temperature 1), GRPO train step, publish (`update_weights_from_tensor`, CUDA IPC). Without offload the learner
stays on the GPU next to SGLang; an out-of-memory error (SGLang refusing to start, or CUDA OOM) is recorded as
the result. Prints one JSON line per step and a summary line {"arch", "offload", "ok", "oom", "step_s_median",
peaks}; appends it to $OUT/colocated_offload.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from agentrl.actors.handoff import HandOff, PeakMeter  # noqa: E402
from agentrl.config import AlgorithmSection, LearnerSection  # noqa: E402
from agentrl.engines.base import SamplingParams, TensorSource  # noqa: E402
from agentrl.engines.sglang import SGLangEngine  # noqa: E402
from agentrl.engines.sglang_launcher import SGLangServer  # noqa: E402
from agentrl.learners.batch import build_batch  # noqa: E402
from agentrl.learners.torch_learner import TorchLearner  # noqa: E402

engine_bench.ARCHS.update({  # Qwen3-1.7B / Qwen3-4B shapes (random weights)
    "qwen3-1.7b": dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
                       vocab=151936, tie=True),
    "qwen3-4b": dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728,
                     vocab=151936, tie=True),
})  # fmt: skip
SGLANG_FLAGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
                "disable_piecewise_cuda_graph": True, "skip_server_warmup": True, "skip_tokenizer_init": True,
                "dtype": "bfloat16"}  # fmt: skip
PROMPTS, SAMPLES = 8, 8


def is_oom(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "not enough memory" in text


async def rollout(engine: SGLangEngine, vocab: int, version: int, step: int, new_tokens: int):
    g = torch.Generator().manual_seed(step)
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [torch.randint(vocab, (128,), generator=g).tolist() for _ in range(PROMPTS)]
    outs = await asyncio.gather(*(engine.generate(p, sp) for p in prompts for _ in range(SAMPLES)))
    trajs = []
    for i, out in enumerate(outs):
        t = types.Trajectory(id=f"{step}-{i}", group_id=f"{step}-{i // SAMPLES}", prompt_ids=prompts[i // SAMPLES],
                             response_ids=out.output_ids, logprobs=types.pack_floats(out.logprobs),
                             reward=float(torch.rand((), generator=g)), policy_version=version)  # fmt: skip
        trajs.append(types.normalize(t))
    return trajs


async def run(args) -> dict:
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / args.arch
    if not (path / "config.json").exists():
        engine_bench.build_model(args.arch, root, "bfloat16", "cuda")
        torch.cuda.empty_cache()
    lc = LearnerSection(device="cuda", dtype="bfloat16", lr=1e-6, gradient_checkpointing=True,
                        micro_batch_tokens=args.micro_batch_tokens)  # fmt: skip
    result: dict = {"arch": args.arch, "offload": args.offload, "ok": False, "oom": False, "steps": []}
    learner = TorchLearner(path, lc, AlgorithmSection(advantage="grpo"))
    result["learner_params_b"] = round(sum(p.numel() for p in learner.model.parameters()) / 1e9, 2)
    if args.offload:
        learner.offload()
    flags = {
        **SGLANG_FLAGS,
        "mem_fraction_static": args.mem_fraction,
        "enable_memory_saver": args.offload,
        "enable_weights_cpu_backup": args.offload,
    }  # as agentrl.actors.engine launches it with run.offload
    server = SGLangServer(str(path), args=flags, log_path=str(Path(args.out) / f"sglang_{args.arch}_{args.offload}.log"),
                          startup_timeout_s=600, restart_on_crash=False)  # fmt: skip
    engine, handoff, meter = None, None, None
    phase = "sglang start"
    try:
        await asyncio.to_thread(server.start)
        engine = SGLangEngine(server.url, update_timeout_s=600, request_timeout_s=600)
        meter = PeakMeter()
        handoff = HandOff(learner, [engine], meter) if args.offload else None
        version = 0

        async def publish():
            update = lambda: engine.update_weights(version, TensorSource(dict(learner.weights())))  # noqa: E731
            return await (handoff.publish(update) if handoff else update())

        phase = "first publish"
        await publish()
        for step in range(args.steps):
            t0 = time.perf_counter()
            phase = "rollout"
            trajs = await rollout(engine, learner.model.config.vocab_size, version, step, args.new_tokens)
            t1 = time.perf_counter()
            phase = "train"
            if handoff:
                await handoff.to_training()
            rollout_peak = None if handoff else meter.take()
            stats = await asyncio.to_thread(learner.train_step, build_batch(trajs, learner.pad_id, "cuda"))
            mem = handoff.train_metrics() if handoff else {"memory/rollout_peak_gib": rollout_peak,
                                                            "memory/train_peak_gib": meter.take()}  # fmt: skip
            t2 = time.perf_counter()
            phase = "publish"
            version = learner.policy_version
            await publish()
            t3 = time.perf_counter()
            row = {"step": step, "rollout_s": round(t1 - t0, 2), "train_s": round(t2 - t1, 2),
                   "publish_s": round(t3 - t2, 2), "step_s": round(t3 - t0, 2), "loss": stats["loss"],
                   **{k: round(v, 2) for k, v in mem.items() if v is not None}}  # fmt: skip
            result["steps"].append(row)
            print(json.dumps(row), flush=True)
        result["ok"] = True
    except Exception as exc:  # the no-offload case is expected to end here
        result.update(oom=is_oom(exc), failed_in=phase, error=f"{type(exc).__name__}: {str(exc)[-400:]}")
        if not result["oom"]:
            log = Path(args.out) / f"sglang_{args.arch}_{args.offload}.log"
            tail = log.read_text()[-3000:] if log.exists() else ""
            result["oom"] = "out of memory" in tail.lower() or "not enough memory" in tail.lower()
    finally:
        if engine is not None:
            await engine.close()
        if handoff is not None:
            handoff.close()
        elif meter is not None:
            meter.close()
        await asyncio.to_thread(server.stop)
    timed = [s["step_s"] for s in result["steps"][1:]] or [s["step_s"] for s in result["steps"]]
    if timed:
        result["step_s_median"] = statistics.median(timed)
        result["step_s_range"] = [min(timed), max(timed)]
        for key in ("memory/rollout_peak_gib", "memory/train_peak_gib", "memory/publish_peak_gib"):
            values = [s[key] for s in result["steps"] if key in s]
            if values:
                result[key.replace("memory/", "max_")] = max(values)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3-4b", choices=sorted(engine_bench.ARCHS))
    ap.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mem-fraction", type=float, default=0.35, help="SGLang --mem-fraction-static")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/colocated_offload"))
    ap.add_argument("--workdir", default="/tmp/agentrl_colocated_offload")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args))
    summary = {k: v for k, v in result.items() if k != "steps"}
    with open(Path(args.out) / "colocated_offload.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
