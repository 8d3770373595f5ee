"""Cost of run.true_on_policy: embedded-engine throughput and torch-learner speed, on and off; and how close the
engine's log-probs are to the learner's in each mode.

    PYTHONPATH=. python bench/true_on_policy_cost.py [--hidden 256 --layers 4 --requests 32 --new-tokens 64]
    PYTHONPATH=. python bench/true_on_policy_cost.py --device cuda [--out result.json]   # bench/gpu/true_on_policy.sh

CPU (default): a random dense Qwen2 (`--hidden`, `--layers`), `--requests` concurrent requests of 8..64 prompt
tokens x `--new-tokens`, fp32. CUDA: the GPU engine bench's workload (bench/engine_bench.py: the Qwen3-0.6B
architecture with random weights, 256 requests of U[100, 1024] prompt and output tokens, bf16; the engine with
CUDA graphs, and in its normal mode also compiled, Triton attention and the fused sampler).

For each mode (off, on): one engine serves a short warm-up, then the workload `--repeats` times (generated
tok/s, median); one TorchLearner scores the first run's trajectories before any update (against the engine's
log-probs: how many tokens are bit-equal, mean and max |delta|), then times `train_step` on them `--repeats`
times after a warm-up step (tokens/s, median; at most `--learner-trajectories` trajectories). Prints a markdown
table (docs/benchmarks.md) and the JSON result (`--out`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import _free, _sync, build_model, make_requests

from agentrl import types
from agentrl.config.learning import LearnerSection
from agentrl.engines.base import SamplingParams
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.tiny import make_tiny_model
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner

TEMPERATURE = 1.0


def serve(
    model: str, on: bool, requests, args
) -> tuple[list[float], list[types.Trajectory], list[list[float]]]:
    """Generated tok/s of each timed run, the first run's trajectories and its log-probs as the engine reported
    them."""
    max_len = max(len(p) + m for p, m in requests) + 1
    engine = EmbeddedEngine(
        model, device=args.device, dtype=args.dtype, max_batch_size=len(requests), max_seq_len=max_len, seed=0,
        true_on_policy=on,
    )  # fmt: skip
    sampling = [
        SamplingParams(temperature=TEMPERATURE, max_new_tokens=m, ignore_eos=True) for _, m in requests
    ]

    async def run(reqs, params):
        _sync(args.device)
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(engine.generate(p, sp) for (p, _), sp in zip(reqs, params, strict=True))
        )
        _sync(args.device)
        return outs, sum(len(o.output_ids) for o in outs) / (time.perf_counter() - start)

    async def main():
        try:
            warm = [(p[:8], 4) for p, _ in requests[:8]]
            await run(warm, [SamplingParams(temperature=TEMPERATURE, max_new_tokens=4)] * len(warm))
            rates, first = [], None
            for _ in range(args.repeats):
                outs, rate = await run(requests, sampling)
                rates.append(rate)
                first = first or outs
            return rates, first
        finally:
            await engine.close()

    rates, outs = asyncio.run(main())
    engine = None
    _free(args.device)
    trajs = [
        types.normalize(types.Trajectory(id=f"t{i}", group_id=f"g{i // 4}", prompt_ids=p, response_ids=o.output_ids,
                                         logprobs=o.logprobs, versions=o.versions, reward=float(i % 2)))
        for i, ((p, _), o) in enumerate(zip(requests, outs, strict=True))
    ]  # fmt: skip
    return rates, trajs, [o.logprobs for o in outs]


def agreement(learner, trajs, engine_logprobs, requests) -> tuple[dict, object]:
    """The learner's log-probs of the trajectories (before any update) against the engine's: how many tokens are
    bit-equal, mean and max |delta|; and the batch."""
    batch = build_batch(trajs, pad_id=learner.pad_id)
    logp = learner.compute_logprobs(batch)
    mine, theirs = [], []
    for i, ((prompt, _), reported) in enumerate(zip(requests, engine_logprobs, strict=True)):
        row, cols = (batch.seq_index == i).nonzero(as_tuple=True)
        mine.append(logp[row, cols][len(prompt) :].cpu())
        theirs.append(torch.tensor(reported, dtype=torch.float32))
    delta = (torch.cat(mine) - torch.cat(theirs)).abs()
    return {"tokens": delta.numel(), "bit_equal": int((delta == 0).sum()), "mean_abs": float(delta.mean()),
            "max_abs": float(delta.max())}, batch  # fmt: skip


def megatron_agreement(model: str, trajs, engine_logprobs, requests, args) -> dict:
    """The Megatron learner (bf16, TP = 1) against the engine's true-on-policy log-probs: how close it gets."""
    try:
        from agentrl.learners.megatron.learner import MegatronLearner
    except ImportError as exc:
        return {"error": f"megatron-core not installed: {exc}"}
    section = LearnerSection(kind="megatron", device=args.device, dtype=args.dtype)
    try:
        learner = MegatronLearner(model, section, temperature=TEMPERATURE)
        out, _ = agreement(learner, trajs, engine_logprobs, requests)
    except Exception as exc:  # the measurement is an extra: it must not cost the run's other results
        import traceback

        traceback.print_exc()
        return {"error": repr(exc)[:500]}
    learner = None
    _free(args.device)
    return out


def learn(model: str, on: bool, trajs: list[types.Trajectory], engine_logprobs: list[list[float]], requests,
          args) -> tuple[dict, list[float]]:  # fmt: skip
    """(engine vs learner log-probs before any update, train_step tokens/s of each timed step)."""
    section = LearnerSection(kind="torch", device=args.device, dtype=args.dtype)
    learner = TorchLearner(model, section, temperature=TEMPERATURE, true_on_policy=on)
    agreed, batch = agreement(learner, trajs, engine_logprobs, requests)
    tokens = int((batch.seq_index >= 0).sum())
    rates = []
    for i in range(args.repeats + 1):  # the first step warms up (kernels compiled, allocator grown)
        _sync(args.device)
        start = time.perf_counter()
        learner.train_step(batch)
        _sync(args.device)
        if i:
            rates.append(tokens / (time.perf_counter() - start))
    learner = None
    _free(args.device)
    return agreed, rates


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tile configs the CUDA sweep times against cuBLAS
MATMUL_CANDIDATES = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3)]
# (N, K) of the Qwen3-0.6B architecture's matmuls: qkv, o, gate_up, down, lm_head
MATMUL_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151_936, 1024)]


def matmul_sweep() -> list[dict]:
    """Each candidate tile config of the invariant matmul: its time over one layer's and the lm_head's matmuls
    against cuBLAS (F.linear) at decode-sized and learner-sized M, and whether its outputs equal the default
    config's bit for bit (if they do for every M, per-M configs sharing BLOCK_K would stay invariant)."""
    from agentrl import invariant_triton as kernels

    default = kernels.MATMUL_CONFIG
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [
        torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16) * 0.03 for n, k in MATMUL_SHAPES
    ]
    inputs = {m: [torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16) for _, k in MATMUL_SHAPES]
              for m in (8, 64, 256, 8192)}  # fmt: skip

    def timed(fn, m, shapes) -> float:
        for _ in range(2):
            fn(m, shapes)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn(m, shapes)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 10

    def run_kernel(m, shapes):
        return [kernels.matmul(inputs[m][i], weights[i]) for i in shapes]

    def run_cublas(m, shapes):
        return [torch.nn.functional.linear(inputs[m][i], weights[i]) for i in shapes]

    every = range(len(MATMUL_SHAPES))
    reference = {m: run_kernel(m, every) for m in inputs}
    rows = []
    try:
        for config in MATMUL_CANDIDATES:
            kernels.MATMUL_CONFIG = config
            row = {"config": list(config), "bit_equal_to_default": all(
                torch.equal(a, b) for m in inputs for a, b in zip(run_kernel(m, every), reference[m], strict=True))}  # fmt: skip
            for m in inputs:
                row[f"m{m}_over_cublas"] = round(timed(run_kernel, m, every) / timed(run_cublas, m, every), 3)
            # per weight shape (N x K): a tile config may follow the weight's shape, never M
            row["by_shape_over_cublas"] = {
                f"{n}x{k}": {
                    m: round(timed(run_kernel, m, [i]) / timed(run_cublas, m, [i]), 3) for m in inputs
                }
                for i, (n, k) in enumerate(MATMUL_SHAPES)
            }
            rows.append(row)
            print(json.dumps({"matmul": row}), file=sys.stderr, flush=True)
    finally:
        kernels.MATMUL_CONFIG = default
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=256, help="CPU model")
    ap.add_argument("--layers", type=int, default=4, help="CPU model")
    ap.add_argument("--requests", type=int, default=None, help="default: 32 on CPU, 256 on CUDA")
    ap.add_argument("--new-tokens", type=int, default=64, help="CPU workload")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--learner-trajectories", type=int, default=None, help="default: all on CPU, 64 on CUDA")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--megatron", action="store_true", help="also score the on-mode trajectories with Megatron"
    )
    ap.add_argument("--matmul-config", help="CUDA: the invariant matmul's tile config BM,BN,BK,warps,stages")
    ap.add_argument("--sweep", action="store_true", help="CUDA: time the matmul tile candidates first")
    ap.add_argument("--out", help="also write the JSON result here")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.dtype = "bfloat16" if cuda else "float32"
    args.requests = args.requests or (256 if cuda else 32)
    torch.set_num_threads(args.threads)
    sweep = None
    if cuda and args.sweep:
        try:
            sweep = matmul_sweep()
        except Exception as exc:  # an extra too: the on/off measurement goes on without it
            import traceback

            traceback.print_exc()
            sweep = [{"error": repr(exc)[:500]}]
    if args.matmul_config:
        from agentrl import invariant_triton

        invariant_triton.MATMUL_CONFIG = tuple(int(v) for v in args.matmul_config.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        if cuda:
            model = str(build_model("qwen3-0.6b", Path(tmp), args.dtype, args.device))
            requests = make_requests(args.requests, (100, 1024), (100, 1024), 151_936, 0)
            shape = "Qwen3-0.6B architecture (random weights), bf16"
        else:
            model = str(make_tiny_model(tmp, "qwen2", hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                                        vocab_size=300))  # fmt: skip
            gen = torch.Generator().manual_seed(0)
            requests = [(torch.randint(5, 300, (int(torch.randint(8, 65, (1,), generator=gen)),),
                                       generator=gen).tolist(), args.new_tokens) for _ in range(args.requests)]  # fmt: skip
            shape = f"Qwen2 hidden {args.hidden}, {args.layers} layers, fp32, {args.threads} threads"
        result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "model": shape,
                  "requests": len(requests), "repeats": args.repeats, "matmul_sweep": sweep}  # fmt: skip
        if cuda:
            from agentrl import invariant_triton

            result["matmul_config"] = list(invariant_triton.MATMUL_CONFIG)
        for on in (False, True):
            name = "on" if on else "off"
            rates, trajs, reported = serve(model, on, requests, args)
            keep = args.learner_trajectories or (64 if cuda else len(trajs))
            agreement, learner_rates = learn(model, on, trajs[:keep], reported[:keep], requests[:keep], args)
            result[name] = {"engine_tok_s": statistics.median(rates), "engine_runs_tok_s": rates,
                            "learner_tok_s": statistics.median(learner_rates), "learner_runs_tok_s": learner_rates,
                            "engine_vs_learner_logprobs": agreement}  # fmt: skip
            if on and args.megatron:
                result["megatron_vs_engine_on"] = megatron_agreement(
                    model, trajs[:keep], reported[:keep], requests[:keep], args
                )
            print(json.dumps({name: result[name]}), file=sys.stderr, flush=True)
    off, on = result["off"], result["on"]
    result["engine_on_over_off"] = on["engine_tok_s"] / off["engine_tok_s"]
    result["learner_on_over_off"] = on["learner_tok_s"] / off["learner_tok_s"]
    print(f"{shape}; {len(requests)} requests; medians of {args.repeats}")
    print("| | true_on_policy off | on | on / off |\n|---|---|---|---|")
    print(f"| engine, generated tok/s | {off['engine_tok_s']:,.0f} | {on['engine_tok_s']:,.0f} | "
          f"{result['engine_on_over_off']:.2f} |")  # fmt: skip
    print(f"| learner train_step, tok/s | {off['learner_tok_s']:,.0f} | {on['learner_tok_s']:,.0f} | "
          f"{result['learner_on_over_off']:.2f} |")  # fmt: skip
    for name in ("off", "on"):
        a = result[name]["engine_vs_learner_logprobs"]
        print(f"| engine vs learner log-probs ({name}) | {a['bit_equal']:,} of {a['tokens']:,} tokens bit-equal, "
              f"mean abs delta {a['mean_abs']:.2e}, max {a['max_abs']:.2e} | | |")  # fmt: skip
    for row in [r for r in sweep or [] if "config" in r]:
        print(f"| matmul tile {row['config']} / cuBLAS | " + ", ".join(
            f"{k[1:].split('_')[0]} rows {v}" for k, v in row.items() if k.startswith("m"))
            + f" | equal to default: {row['bit_equal_to_default']} | |")  # fmt: skip
    if "megatron_vs_engine_on" in result:
        a = result["megatron_vs_engine_on"]
        print(f"| Megatron learner vs the engine (on) | {json.dumps(a)} | | |")
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
