"""Embedded engine vs Hugging Face `generate`: output tokens/s on the same model in the same run.

N requests with prompt lengths ~ U[a, b] and output lengths ~ U[c, d] (random token ids, eos ignored,
temperature 1, logprobs on), all submitted at once to the embedded engine; HF `generate` runs the same
requests in left-padded batches of --hf-batch-size (each batch runs to its longest output; only the
requested tokens are counted). Prints one JSON line (and writes it to --out).

    # CPU, tiny model (what the CPU numbers in docs/benchmarks use)
    python bench/engine_bench.py --arch tiny --n 64 --prompt-len 16 64 --output-len 16 64
    # GPU, Qwen3-0.6B architecture, random bf16 weights (the SGLang comparison workload)
    python bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 --prompt-len 100 1024 \
        --output-len 100 1024 --hf-batch-size 256
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrl.engines import model as model_mod
from agentrl.engines.base import SamplingParams
from agentrl.engines.embedded import DTYPES, EmbeddedEngine

QWEN3_06B = dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936,
                 tie=True)  # fmt: skip
# random-init architectures the GPU scripts build (qwen3-8b: publish bandwidth at a realistic size)
ARCHS = {"qwen3-0.6b": QWEN3_06B,
         "qwen3-8b": dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                          vocab=151936, tie=False)}  # fmt: skip


# random-init mixtures of experts with fewer layers (MoE engine and routing-replay checks)
MOE_ARCHS = {
    # Qwen3-30B-A3B's layer: hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768, top-8
    "qwen3-30b-a3b-4l": dict(cls="Qwen3MoeConfig", vocab_size=151936, hidden_size=2048, num_hidden_layers=4,
                             num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                             moe_intermediate_size=768, num_experts=128, num_local_experts=128,
                             num_experts_per_tok=8, norm_topk_prob=True),
    # GLM-4.5-Air's layer: hidden 4096, 96 q / 8 kv heads of 128, 128 experts of 1408 + 1 shared, top-8; layer 0 dense
    "glm45-air-3l": dict(cls="Glm4MoeConfig", vocab_size=151552, hidden_size=4096, num_hidden_layers=3,
                         num_attention_heads=96, num_key_value_heads=8, head_dim=128, intermediate_size=10944,
                         moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1,
                         num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
                         routed_scaling_factor=1.0, norm_topk_prob=True, partial_rotary_factor=0.5,
                         attention_bias=True, use_qk_norm=False),
}  # fmt: skip


def build_model(arch: str, root: Path, dtype: str, device: str, overrides: dict | None = None) -> Path:
    """Write the model to `root` (tiny: the offline kit; else random init of that `ARCHS` / `MOE_ARCHS`
    architecture; `overrides`: config fields of an MoE architecture to change, e.g. num_hidden_layers)."""
    if arch == "tiny":
        from agentrl.engines.tiny import make_tiny_model

        return make_tiny_model(root / "tiny", arch="qwen3", seed=0)
    if arch in MOE_ARCHS:
        return _build_moe(arch, root, dtype, device, overrides or {})
    from transformers import AutoModelForCausalLM, Qwen3Config

    s = ARCHS[arch]
    config = Qwen3Config(
        vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        intermediate_size=s["intermediate"], max_position_embeddings=40960, tie_word_embeddings=s["tie"],
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        eos_token_id=151645, pad_token_id=151643, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    path = root / arch
    model.save_pretrained(path, safe_serialization=True)
    del model
    return path


def _build_moe(arch: str, root: Path, dtype: str, device: str, overrides: dict) -> Path:
    import transformers

    spec = {**MOE_ARCHS[arch], **overrides}
    cls = getattr(transformers, spec.pop("cls"))
    special = spec["vocab_size"] - 1  # Qwen's special ids where the vocabulary holds them (GLM's is smaller)
    ids = {"eos_token_id": min(151645, special), "pad_token_id": min(151643, special), "bos_token_id": None}
    ids.update({key: spec.pop(key) for key in list(ids) if key in spec})
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0,
            "partial_rotary_factor": spec.get("partial_rotary_factor", 1.0)}  # fmt: skip
    config = cls(**spec, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 rope_parameters=rope, **ids)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    for layer in model.model.layers:  # GLM: a nonzero correction bias, so choosing differs from weighting
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        if bias is not None:
            bias.data.normal_(0.0, 0.02)
    path = root / arch
    model.save_pretrained(path, safe_serialization=True)
    del model
    return path


def make_requests(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
        for _ in range(n)
    ]


async def run_engine(engine, requests, seeded: bool = True) -> tuple[int, float, list]:
    """Every request at once; (output tokens, seconds, outputs)."""
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=m, ignore_eos=True, seed=i if seeded else None)
        for i, (_, m) in enumerate(requests)
    ]
    start = time.perf_counter()
    outs = await asyncio.gather(
        *(engine.generate(p, sp) for (p, _), sp in zip(requests, params, strict=True))
    )
    elapsed = time.perf_counter() - start
    assert all(len(o.output_ids) == m for o, (_, m) in zip(outs, requests, strict=True)), (
        "eos was not ignored"
    )
    return sum(len(o.output_ids) for o in outs), elapsed, outs


async def run_unseeded(engine, requests) -> tuple[int, float, list]:
    """`run_engine` without per-request seeds (SGLang's client takes none)."""
    return await run_engine(engine, requests, seeded=False)


def warm_requests(requests) -> list:
    """A few short requests served before the timed runs (compilation and allocation stay out of them)."""
    return [(p[:8], 4) for p, _ in requests[:8]]


def throughput(tokens: int, seconds: float) -> dict:
    return {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1)}


async def timed_runs(engine, serve, requests, warm, runs: int, label: str, flush_cache: bool = False):
    """`runs` passes of `serve(engine, requests) -> (output tokens, seconds, outputs)` after one pass over
    `warm`; each pass's throughput goes to stderr as it ends (a long GPU run shows its progress).
    `flush_cache`: SGLang's radix cache is emptied before every pass, so that a repeated pass is not served
    cached prompts. Returns every pass's throughput and the last pass's outputs."""
    await serve(engine, warm)
    out, outputs = [], []
    for _ in range(runs):
        if flush_cache:
            await engine.flush_cache()
        tokens, seconds, outputs = await serve(engine, requests)
        out.append(throughput(tokens, seconds))
        print(json.dumps({label: out[-1]}), file=sys.stderr, flush=True)
    return out, outputs


DEFAULT_COMPILE_OPTIONS = dict(model_mod.COMPILE_OPTIONS)
# name -> (cuda_graphs, attention, torch.compile'd decode layers, decode steps per scheduler iteration, sampler)
VARIANTS = {"eager": (False, "sdpa", False, 1, "auto"), "triton": (False, "triton", False, 1, "auto"),
            "graphs": (True, "triton", True, 1, "auto"), "graphs_nocompile": (True, "triton", False, 1, "auto"),
            "graphs_sdpa": (True, "sdpa", True, 1, "auto"), "graphs_k4": (True, "triton", True, 4, "auto"),
            "graphs_k8": (True, "triton", True, 8, "auto"),
            "graphs_k8_torch_sampler": (True, "triton", True, 8, "torch"),
            "graphs_k8_fp32_casts": (True, "triton", True, 8, "auto")}  # fmt: skip


def bench_embedded(path: Path, requests, args, variant: str = "eager") -> dict:
    max_len = max([len(p) + m for p, m in requests] + ([600] if args.check_logprobs else []))
    graphs, attention, compiled, per_iteration, sampler = VARIANTS[variant]
    # "_fp32_casts": inductor keeps fp32 intermediates (faster, further from transformers' numerics)
    options = {} if variant.endswith("_fp32_casts") else DEFAULT_COMPILE_OPTIONS
    if options != model_mod.COMPILE_OPTIONS:
        model_mod.COMPILE_OPTIONS = options
        torch._dynamo.reset()  # compiled code does not guard on inductor options
    if not args.device.startswith("cuda"):
        graphs, attention, compiled = False, "sdpa", False
    engine = EmbeddedEngine(
        str(path), device=args.device, dtype=args.dtype, max_batch_size=min(args.max_batch_size, len(requests)),
        max_seq_len=max_len + 1, max_prefill_tokens=args.max_prefill_tokens, cuda_graphs=graphs, attention=attention,
        compile=compiled, decode_steps=per_iteration, sampler=sampler,
    )  # fmt: skip

    async def go():
        await run_engine(engine, warm_requests(requests))
        _sync(args.device)
        steps0, stats0 = engine.steps, dict(engine.stats)
        tokens, elapsed, _ = await run_engine(engine, requests, seeded=args.seeded)
        _sync(args.device)
        steps = engine.steps - steps0
        split = {k: round(v - stats0[k], 3) for k, v in engine.stats.items()}
        split["host_s"] = round(elapsed - split["prefill_s"] - split["decode_s"], 3)
        check = await logprob_check(engine, path, args) if args.check_logprobs else None
        await engine.close()
        return tokens, elapsed, steps, check, split

    tokens, elapsed, steps, check, split = asyncio.run(go())
    cache_gb = engine.cache.nbytes() / 2**30
    engine = None
    _free(args.device)
    out = {**throughput(tokens, elapsed), "steps": steps, "kv_cache_gib": round(cache_gb, 2),
           "cuda_graphs": graphs, "attention": attention, "compile": compiled,
           "decode_steps_per_iteration": per_iteration, "sampler": sampler}  # fmt: skip
    out["time_split"] = split  # seconds in prefill / decode steps, and host work between them
    if check is not None:
        out["logprob_vs_hf"] = check
    return out


async def logprob_check(engine, path: Path, args) -> dict:
    """Engine logprobs of sampled tokens vs a teacher-forced HF forward of the same weights (mean/max |d|)."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(1)
    vocab = engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (17, 64, 200, 500)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True)
    outs = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).to(args.device).eval()
    diffs = []
    with torch.inference_mode():
        for p, o in zip(prompts, outs, strict=True):
            ids = torch.tensor([p + o.output_ids], device=args.device)
            logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(
                1, torch.tensor(o.output_ids, device=args.device)[:, None]
            )
            diffs.append((torch.tensor(o.logprobs, device=args.device) - want[:, 0]).abs())
    del model
    d = torch.cat(diffs)
    return {
        "mean_abs": round(float(d.mean()), 5),
        "max_abs": round(float(d.max()), 5),
        "tokens": int(d.numel()),
    }


def bench_hf(path: Path, requests, args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).to(args.device).eval()
    pad = model.config.pad_token_id or 0
    model.generation_config.eos_token_id = None  # eos ignored (cheaper than min_new_tokens' logits processor)
    useful, elapsed = 0, 0.0
    bs = args.hf_batch_size or len(requests)
    for i in range(0, len(requests), bs):
        batch = requests[i : i + bs]
        longest = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in batch], device=args.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch], device=args.device)
        new = max(m for _, m in batch)
        _sync(args.device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=True,
                           temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)  # fmt: skip
        _sync(args.device)
        elapsed += time.perf_counter() - start
        useful += sum(m for _, m in batch)
    del model
    _free(args.device)
    return {
        "tokens": useful,
        "seconds": round(elapsed, 3),
        "tok_s": round(useful / elapsed, 1),
        "batch_size": bs,
    }


def bench_hf_fitting(path: Path, requests, args) -> dict:
    """HF generate, halving the batch size on CUDA out-of-memory (its KV cache grows by concatenation)."""
    while True:
        bs = args.hf_batch_size or len(requests)
        try:
            return bench_hf(path, requests, args)
        except torch.cuda.OutOfMemoryError:
            if bs <= 1:
                raise
        _free(args.device)  # outside the except block: the traceback no longer pins the model
        args.hf_batch_size = bs // 2
        print(f"hf generate: out of memory at batch {bs}, retrying with {bs // 2}", file=sys.stderr)


SGLANG_FLAGS = {
    "attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
    "disable_piecewise_cuda_graph": True, "skip_server_warmup": True, "skip_tokenizer_init": True,
    "mem_fraction_static": 0.6,
}  # fmt: skip


def sglang_runs(path: Path, requests, serve, warm, runs: int, flags: dict, log_path: str) -> dict:
    """Real SGLang (launched by agentrl's SGLangServer, driven by its SGLangEngine client) serving `requests`
    `runs` times on ONE server, with `timed_runs`' warm-up, cache flush and `serve`.
    Returns {"runs": [throughput per pass], "startup_s", "flags"}."""
    from agentrl.engines.sglang import SGLangEngine
    from agentrl.engines.sglang_launcher import SGLangServer

    server = SGLangServer(
        str(path), args=flags, log_path=log_path, startup_timeout_s=900, restart_on_crash=False
    )
    start = time.perf_counter()
    server.start()
    startup_s = round(time.perf_counter() - start, 1)

    async def go() -> list[dict]:
        engine = SGLangEngine(server.url, request_timeout_s=1800)
        try:
            passes, _ = await timed_runs(engine, serve, requests, warm, runs, "sglang_run", flush_cache=True)
            return passes
        finally:
            await engine.close()

    try:
        return {"runs": asyncio.run(go()), "startup_s": startup_s, "flags": flags}
    finally:
        server.stop()


def bench_sglang(path: Path, requests, args) -> dict:
    """One SGLang pass over the same requests as the embedded variants."""
    result = sglang_runs(
        path, requests, run_unseeded, warm_requests(requests), 1, SGLANG_FLAGS, args.sglang_log
    )
    return {**result.pop("runs")[0], **result}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["tiny", "qwen3-0.6b", *MOE_ARCHS], default="tiny")
    ap.add_argument("--model", help="use this HF directory instead of building --arch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--dtype", choices=list(DTYPES), default=None, help="default: float32 on cpu, bfloat16 on cuda"
    )
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--hf-batch-size", type=int, default=0, help="0: all requests in one batch")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--sglang", action="store_true", help="also run real SGLang (installed) on the same requests"
    )
    ap.add_argument("--sglang-log", default="sglang_bench_server.log")
    ap.add_argument(
        "--embedded-variants",
        default="eager",
        help=f"comma list of {', '.join(VARIANTS)} (CUDA graphs / attention kernel; CPU: eager only)",
    )
    ap.add_argument(
        "--seeded", action="store_true", help="give every embedded request its own seed (per-row RNG)"
    )
    ap.add_argument("--check-logprobs", action="store_true", help="embedded logprobs vs an HF forward pass")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON result here")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else build_model(args.arch, Path(tmp), args.dtype, args.device)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        requests = make_requests(args.n, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed)
        result = {
            "arch": args.model or args.arch, "device": args.device, "dtype": args.dtype, "n": args.n,
            "prompt_len": args.prompt_len, "output_len": args.output_len, "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        }  # fmt: skip
        variants = args.embedded_variants.split(",")
        for variant in variants:
            key = "embedded" if variant == variants[0] else f"embedded_{variant}"
            try:
                result[key] = bench_embedded(path, requests, args, variant)
            except Exception as exc:  # a broken variant must not cost the others (GPU time is scarce)
                import traceback

                traceback.print_exc()
                result[key] = {"error": repr(exc)[:500], "tok_s": 0.0}
                _free(args.device)
            result[key]["variant"] = variant
            print(json.dumps({key: result[key]}), file=sys.stderr, flush=True)
        best = max((k for k in result if k.startswith("embedded")), key=lambda k: result[k]["tok_s"])
        if not args.skip_hf:
            result["hf_generate"] = bench_hf_fitting(path, requests, args)
            print(json.dumps({"hf_generate": result["hf_generate"]}), file=sys.stderr, flush=True)
            result["speedup_vs_hf"] = round(result[best]["tok_s"] / result["hf_generate"]["tok_s"], 2)
        if args.sglang:
            result["sglang"] = bench_sglang(path, requests, args)
            result["best_embedded_vs_sglang"] = round(result[best]["tok_s"] / result["sglang"]["tok_s"], 3)
        result["best_embedded"] = best
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
