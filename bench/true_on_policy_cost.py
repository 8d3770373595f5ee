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
import torch.nn.functional as F

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
MATMUL_CANDIDATES = [(64, 64, 64, 4, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 4, 3),
                     (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 4, 3)]  # fmt: skip
# (N, K) of the Qwen3-0.6B architecture's matmuls: qkv, o, gate_up, down, lm_head
MATMUL_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151_936, 1024)]
DECODE_ROWS, LEARNER_ROWS = (16, 128, 256), 8192  # a decode batch's rows; a learner micro-batch's


def matmul_sweep() -> tuple[list[dict], dict[str, list[int]]]:
    """Each candidate tile config of the invariant matmul per weight shape: its time against cuBLAS (F.linear)
    at decode-sized and learner-sized M, and whether its outputs equal the default config's bit for bit. And
    the table it picks: per shape the config with the least (time / cuBLAS at the learner's M) + (the mean of
    time / cuBLAS at the decode Ms), {"NxK": config} (what AGENTRL_INVARIANT_MATMUL and MATMUL_TABLE take)."""
    from agentrl import invariant_triton as kernels

    saved = kernels.MATMUL_OVERRIDE
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [
        torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16) * 0.03 for n, k in MATMUL_SHAPES
    ]
    rows_m = (*DECODE_ROWS, LEARNER_ROWS)
    inputs = {m: [torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16) for _, k in MATMUL_SHAPES]
              for m in rows_m}  # fmt: skip

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 10

    cublas = {(i, m): timed(lambda i=i, m=m: F.linear(inputs[m][i], weights[i]))
              for i in range(len(MATMUL_SHAPES)) for m in rows_m}  # fmt: skip
    kernels.MATMUL_OVERRIDE = kernels.MATMUL_DEFAULT
    reference = {
        (i, m): kernels.matmul(inputs[m][i], weights[i]) for i in range(len(MATMUL_SHAPES)) for m in rows_m
    }
    rows, best = [], {}
    try:
        for config in MATMUL_CANDIDATES:
            kernels.MATMUL_OVERRIDE = config
            row = {"config": list(config), "bit_equal_to_default": True, "by_shape_over_cublas": {}}
            for i, (n, k) in enumerate(MATMUL_SHAPES):
                try:
                    ratios = {m: timed(lambda i=i, m=m: kernels.matmul(inputs[m][i], weights[i])) / cublas[i, m]
                              for m in rows_m}  # fmt: skip
                except Exception as exc:  # a config that does not compile (shared memory) is left out
                    row["by_shape_over_cublas"][f"{n}x{k}"] = repr(exc)[:200]
                    continue
                row["bit_equal_to_default"] &= all(
                    torch.equal(kernels.matmul(inputs[m][i], weights[i]), reference[i, m]) for m in rows_m
                )
                row["by_shape_over_cublas"][f"{n}x{k}"] = {m: round(r, 3) for m, r in ratios.items()}
                score = ratios[LEARNER_ROWS] + statistics.mean(ratios[m] for m in DECODE_ROWS)
                if f"{n}x{k}" not in best or score < best[f"{n}x{k}"][0]:
                    best[f"{n}x{k}"] = (score, list(config))
            rows.append(row)
            print(json.dumps({"matmul": row}), file=sys.stderr, flush=True)
    finally:
        kernels.MATMUL_OVERRIDE = saved
    return rows, {shape: config for shape, (_, config) in best.items()}


# The configurations `--variants` measures on CUDA: (matmul tiles, attention config, fused elementwise and
# backward kernels, decode attention's BLOCK_M). Matmul "table" is agentrl.invariant_triton's MATMUL_TABLE (the
# code's default), "swept" the table this run's --sweep picked, a tuple one config for every matmul; attention
# None is the code's ATTENTION_CONFIG; decode None the same BLOCK_M as every other call.
VARIANTS = {
    "default": ("table", None, True, None),
    "swept": ("swept", None, True, None),
    "unfused": ("table", None, False, None),
    "attn64": ("table", (64, 64, 4, 2), True, None),
    "attn32": ("table", (32, 64, 4, 2), True, None),
    "attn64d16": (
        "table",
        (64, 64, 4, 2),
        True,
        16,
    ),  # the experiment: are 16- and 64-row programs bit-equal?
    "legacy": (
        (64, 64, 64, 4, 3),
        (64, 64, 4, 2),
        False,
        None,
    ),  # one 64x64 tile everywhere, 64-row attention
}
GOALS = {"engine": 0.85, "learner": 0.90}  # on / off throughput at least


def apply_variant(name: str, swept: dict[str, list[int]] | None) -> dict:
    """Set agentrl.invariant_triton's configs to variant `name` (before the engine captures its CUDA graphs
    and the learner runs); returns what it set."""
    from agentrl import invariant_triton as kernels

    if not hasattr(apply_variant, "defaults"):
        apply_variant.defaults = (kernels.MATMUL_OVERRIDE, kernels.ATTENTION_CONFIG)
    base_matmul, base_attention = apply_variant.defaults
    matmul, attention, fused, decode_rows = VARIANTS[name]
    if matmul == "swept":
        if not swept:
            raise ValueError("variant 'swept' needs --sweep")
        kernels.MATMUL_OVERRIDE = {
            tuple(int(v) for v in key.split("x")): tuple(c) for key, c in swept.items()
        }
    else:
        kernels.MATMUL_OVERRIDE = base_matmul if matmul == "table" else matmul
    kernels.ATTENTION_CONFIG = attention or base_attention
    kernels.FUSED = fused
    kernels.ATTENTION_DECODE_BLOCK_M = decode_rows
    return {"matmul": matmul if isinstance(matmul, str) else list(matmul),
            "attention": list(kernels.ATTENTION_CONFIG) + ([f"decode {decode_rows}"] if decode_rows else []),
            "fused": fused}  # fmt: skip


def profile_step(model: str, on: bool, trajs, args, top: int = 15) -> list[dict]:
    """The `top` CUDA kernels of one learner train_step (after a warm-up step) by self CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    section = LearnerSection(kind="torch", device=args.device, dtype=args.dtype)
    learner = TorchLearner(model, section, temperature=TEMPERATURE, true_on_policy=on)
    batch = build_batch(trajs, pad_id=learner.pad_id)
    learner.train_step(batch)
    _sync(args.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        learner.train_step(batch)
        _sync(args.device)

    def own(e) -> float:  # torch >= 2.4 names it self_device_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    events = [e for e in prof.key_averages() if own(e) > 0]
    total = sum(own(e) for e in events)
    events.sort(key=lambda e: -own(e))
    learner = None
    _free(args.device)
    return [{"kernel": e.key[:90], "ms": round(own(e) / 1000, 2), "share": round(own(e) / total, 3),
             "calls": e.count} for e in events[:top]]  # fmt: skip


def measure(model: str, on: bool, requests, args) -> tuple[dict, tuple]:
    """One mode's engine and learner numbers; and (trajectories, reported log-probs, requests) the learner
    scored (the first `--learner-trajectories`)."""
    rates, trajs, reported = serve(model, on, requests, args)
    keep = args.learner_trajectories or (64 if args.device.startswith("cuda") else len(trajs))
    agreement, learner_rates = learn(model, on, trajs[:keep], reported[:keep], requests[:keep], args)
    from agentrl import invariant

    return {"engine_tok_s": statistics.median(rates), "engine_runs_tok_s": rates,
            "learner_tok_s": statistics.median(learner_rates), "learner_runs_tok_s": learner_rates,
            "engine_vs_learner_logprobs": agreement,
            # whether the learner's attention backward ran torch's varlen flash attention (else SDPA per sequence)
            "varlen_backward": any(invariant._VARLEN.values())}, (trajs[:keep], reported[:keep], requests[:keep])  # fmt: skip


def best_variant(variants: dict[str, dict]) -> str | None:
    """The bit-equal variant whose worse ratio, each over its goal, is the highest."""
    equal = {name: v for name, v in variants.items() if v.get("bit_equal_all")}
    if not equal:
        return None
    return max(equal, key=lambda name: min(equal[name]["engine_on_over_off"] / GOALS["engine"],
                                           equal[name]["learner_on_over_off"] / GOALS["learner"]))  # fmt: skip


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
    ap.add_argument("--sweep", action="store_true", help="CUDA: time the matmul tile candidates first")
    ap.add_argument(
        "--variants",
        default="default",
        help=f"CUDA: comma-separated on-mode configurations to measure, of {', '.join(VARIANTS)}",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip the variants that would not finish in this many seconds from the start",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: the learner's top kernels in one train_step, off and the best variant",
    )
    ap.add_argument("--out", help="also write the JSON result here")
    args = ap.parse_args()
    began = time.perf_counter()
    cuda = args.device.startswith("cuda")
    args.dtype = "bfloat16" if cuda else "float32"
    args.requests = args.requests or (256 if cuda else 32)
    names = [v for v in args.variants.split(",") if v] if cuda else ["default"]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    sweep, swept = None, None
    if cuda and args.sweep:
        try:
            sweep, swept = matmul_sweep()
            print(json.dumps({"swept_table": swept, "sweep_s": round(time.perf_counter() - began)}),
                  file=sys.stderr, flush=True)  # fmt: skip
        except Exception as exc:  # an extra too: the on/off measurement goes on without it
            import traceback

            traceback.print_exc()
            sweep = [{"error": repr(exc)[:500]}]
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
                  "requests": len(requests), "repeats": args.repeats, "matmul_sweep": sweep,
                  "swept_table": swept, "variants": {}}  # fmt: skip
        mark = time.perf_counter()
        result["off"], scored = measure(model, False, requests, args)
        print(
            json.dumps({"off": result["off"], "s": round(time.perf_counter() - mark)}),
            file=sys.stderr,
            flush=True,
        )
        longest = 0.0
        for name in names:
            if args.budget_s and time.perf_counter() - began + 1.1 * longest > args.budget_s:
                result["variants"][name] = {"skipped": f"--budget-s {args.budget_s:.0f} would be exceeded"}
                continue
            mark = time.perf_counter()
            try:
                setting = apply_variant(name, swept) if cuda else {}
                row, scored_on = measure(model, True, requests, args)
            except Exception as exc:  # one variant failing (a config that does not compile) ends no others
                import traceback

                traceback.print_exc()
                result["variants"][name] = {"error": repr(exc)[:500]}
                continue
            agreed = row["engine_vs_learner_logprobs"]
            row.update(setting, engine_on_over_off=row["engine_tok_s"] / result["off"]["engine_tok_s"],
                       learner_on_over_off=row["learner_tok_s"] / result["off"]["learner_tok_s"],
                       bit_equal_all=agreed["bit_equal"] == agreed["tokens"])  # fmt: skip
            if args.megatron and "megatron_vs_engine_on" not in result:
                result["megatron_vs_engine_on"] = megatron_agreement(model, *scored_on, args)
            longest = max(longest, time.perf_counter() - mark)
            row["s"] = round(time.perf_counter() - mark)
            result["variants"][name] = row
            print(json.dumps({name: row}), file=sys.stderr, flush=True)
        best = best_variant(result["variants"])
        result["best"] = best
        if best is not None:  # the summary's "on": the best variant
            result["on"] = result["variants"][best]
            result["engine_on_over_off"] = result["on"]["engine_on_over_off"]
            result["learner_on_over_off"] = result["on"]["learner_on_over_off"]
        report(result, shape, len(requests), args.repeats)
        write(result, args.out)
        if cuda and args.profile and not (args.budget_s and time.perf_counter() - began > args.budget_s):
            try:
                result["profile_off"] = profile_step(model, False, scored[0][:16], args)
                apply_variant(best or names[0], swept)
                result["profile_on"] = profile_step(model, True, scored[0][:16], args)
            except Exception as exc:
                import traceback

                traceback.print_exc()
                result["profile_error"] = repr(exc)[:500]
            for mode in ("off", "on"):
                for k in result.get(f"profile_{mode}") or []:
                    print(
                        f"profile {mode}: {k['share']:6.1%} {k['ms']:9.2f} ms {k['calls']:6d}x {k['kernel']}"
                    )
            write(result, args.out)


def write(result: dict, out: str | None) -> None:
    line = json.dumps(result)
    print(line, flush=True)
    if out:
        Path(out).write_text(line + "\n")


def report(result: dict, shape: str, requests: int, repeats: int) -> None:
    """The markdown table of each variant's on / off, the off mode's log-prob agreement, the best variant, the
    sweep."""
    off = result["off"]
    print(f"{shape}; {requests} requests; medians of {repeats}")
    print(f"true_on_policy off: engine {off['engine_tok_s']:,.0f} generated tok/s, learner train_step "
          f"{off['learner_tok_s']:,.0f} tok/s")  # fmt: skip
    print(
        "| variant | matmul | attention | fused | engine tok/s | on / off | learner tok/s | on / off | bit-equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, v in result["variants"].items():
        if "engine_tok_s" not in v:
            print(f"| {name} | {v.get('skipped') or v.get('error')} | | | | | | | |")
            continue
        a = v["engine_vs_learner_logprobs"]
        print(f"| {name} | {v.get('matmul', '')} | {v.get('attention', '')} | {v.get('fused', '')} | "
              f"{v['engine_tok_s']:,.0f} | "
              f"{v['engine_on_over_off']:.2f} | {v['learner_tok_s']:,.0f} | {v['learner_on_over_off']:.2f} | "
              f"{a['bit_equal']:,} of {a['tokens']:,} |")  # fmt: skip
    a = off["engine_vs_learner_logprobs"]
    print(f"off: engine vs learner log-probs {a['bit_equal']:,} of {a['tokens']:,} tokens bit-equal, mean abs "
          f"delta {a['mean_abs']:.2e}, max {a['max_abs']:.2e}")  # fmt: skip
    best = result.get("best")
    if best is None:
        print("BEST: none (no variant was bit-equal on every token)")
    else:
        v = result["variants"][best]
        met = v["engine_on_over_off"] >= GOALS["engine"] and v["learner_on_over_off"] >= GOALS["learner"]
        print(f"BEST: {best} (engine {v['engine_on_over_off']:.2f}x, learner {v['learner_on_over_off']:.2f}x; "
              f"goals >= {GOALS['engine']} / {GOALS['learner']} met: {'yes' if met else 'no'})")  # fmt: skip
    if result.get("swept_table"):
        print("swept MATMUL_TABLE entry: " + json.dumps(result["swept_table"]))
    for row in [r for r in result.get("matmul_sweep") or [] if "config" in r]:
        print(f"matmul tile {row['config']} (equal to default: {row['bit_equal_to_default']}) / cuBLAS by shape "
              f"{{rows: ratio}}: {json.dumps(row['by_shape_over_cublas'])}")  # fmt: skip
    if "megatron_vs_engine_on" in result:
        print(f"Megatron learner vs the engine (on): {json.dumps(result['megatron_vs_engine_on'])}")


if __name__ == "__main__":
    main()
