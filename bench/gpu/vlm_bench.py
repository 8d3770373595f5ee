"""Vision-language serving: the embedded engine against real SGLang on image+text requests, and the embedded
engine's log-probs against transformers' (the torch learner's forward) on the same pictures.

    python3 bench/gpu/vlm_bench.py --out $OUT/vlm_bench.json                  # CUDA + SGLang installed
    python3 bench/gpu/vlm_bench.py --device cpu --arch tiny --n 8 --prompt-len 8 16 --output-len 8 16 \
        --no-sglang --runs 2 --check-logprobs 2                                # CPU smoke

Workload: `--n` requests (default 256), each one user turn holding one random-noise picture (`--image-size`
pixels square: 224 -> 16 image tokens with the tiny VLM's processor, which caps a picture at 12,544 pixels;
Qwen2.5-VL's own makes 64) and a question, followed by U[prompt-len] random text tokens; each asks
U[output-len] new tokens with eos ignored. `--arch qwen2.5-vl-3b` is Qwen2.5-VL-3B's architecture with random
weights (the tiny model's tokenizer and image processor, so the image tokens are the same ids). Each engine
serves the whole set `--runs` times; the JSON gives every run's tok/s, the median, and the embedded / SGLang
ratio of the medians. `--check-logprobs K`: K requests' sampled tokens scored by the torch learner
(transformers' Qwen2.5-VL forward, pixels from the same processor; on CUDA also in bf16), max and mean |Δ|.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine_bench as eb  # (bench/engine_bench.py owns the timed runs and the SGLang server's lifetime)

from agentrl import types
from agentrl.chat import chat_tokens
from agentrl.engines.base import SamplingParams
from agentrl.engines.tiny import make_tiny_model
from agentrl.tokenizer import load_tokenizer

# Qwen2.5-VL-3B-Instruct's config.json, weights random
QWEN25_VL_3B = {
    "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 128000,
    "tie_word_embeddings": True, "vocab_size": 151936, "initializer_range": 0.02,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "in_chans": 3,
                      "hidden_act": "silu", "tokens_per_second": 2, "initializer_range": 0.02},
}  # fmt: skip
SGLANG_FLAGS = {
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "grammar_backend": "none",
    "disable_piecewise_cuda_graph": True,
    "skip_server_warmup": True,
    "mem_fraction_static": 0.6,
    "mm_attention_backend": "triton_attn",  # the vision tower's attention: the trimmed sgl-kernel has no FA3
}


def build_model(arch: str, root: Path, device: str) -> Path:
    tiny = make_tiny_model(root / "tiny", arch="qwen2_5_vl", seed=0, init_std=0.1)
    if arch == "tiny":
        return tiny
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(tiny)
    text = cfg.text_config if hasattr(cfg, "text_config") else cfg
    for key, value in QWEN25_VL_3B.items():
        if key == "vision_config":
            for k, v in value.items():
                setattr(cfg.vision_config, k, v)
        else:
            setattr(text, key, value)
            setattr(cfg, key, value)
    for c in {id(text): text, id(cfg): cfg}.values():  # the tiny model's per-layer list has its own depth
        if getattr(c, "layer_types", None) is not None:
            c.layer_types = ["full_attention"] * text.num_hidden_layers
        if hasattr(c, "rope_parameters"):  # transformers 5 reads RoPE here (rope_scaling is its alias)
            c.rope_parameters = {"rope_type": "default", "rope_theta": QWEN25_VL_3B["rope_theta"],
                                 "mrope_section": QWEN25_VL_3B["rope_scaling"]["mrope_section"]}  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16)
    out = root / arch
    model.save_pretrained(out)
    for f in tiny.iterdir():  # tokenizer, chat template, image processor: the tiny model's
        if f.suffix in (".json", ".jinja", ".txt") and f.name not in (
            "config.json",
            "generation_config.json",
        ):
            (out / f.name).write_bytes(f.read_bytes())
    del model
    return out


def picture(rng: random.Random, size: int, kind: str = "noise") -> bytes:
    """A `size`-pixel square PNG: uniform noise (every pixel its own; the default), one flat colour, or the
    `shapes` env's coloured shapes on white."""
    from PIL import Image

    if kind == "shapes":
        from agentrl.envs.shapes import draw, sample_shapes

        return draw(size, sample_shapes(rng, size, rng.randint(1, 3), (size // 8, size // 5)))
    if kind == "flat":
        pixels = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    else:
        pixels = Image.frombytes(
            "RGB", (size, size), bytes(rng.getrandbits(8) for _ in range(size * size * 3))
        )
    buf = io.BytesIO()
    pixels.save(buf, "PNG")
    return buf.getvalue()


def make_requests(path: Path, args) -> list[tuple[list[int], list[types.Image], int]]:
    """(prompt ids with the picture's tokens placed, [the picture], new tokens) per request; the pictures'
    spans by request index in `SPANS` (the log-prob check places them)."""
    rng = random.Random(args.seed)
    SPANS.clear()
    tok = load_tokenizer(path)
    chat = chat_tokens(tok)
    specials = set(tok.all_special_ids)
    text_ids = [i for i in range(len(tok)) if i not in specials][:4000]
    out = []
    for _ in range(args.n):
        data = picture(rng, args.image_size, getattr(args, "picture", "noise"))
        opening = [types.Message("user", [types.ImagePart(data), types.TextPart("Describe the picture.")])]
        ids, spans = chat.place_images(chat.prompt_ids(opening), opening)
        SPANS.append(spans)
        ids = ids + [rng.choice(text_ids) for _ in range(rng.randint(*args.prompt_len))]
        out.append((ids, [types.image(data)], rng.randint(*args.output_len)))
    return out


SPANS: list[list[types.ImageSpan]] = []


async def serve(engine, requests) -> tuple[int, float, list]:
    params = [SamplingParams(temperature=1.0, max_new_tokens=m, ignore_eos=True) for _, _, m in requests]
    start = time.perf_counter()
    outs = await asyncio.gather(
        *(engine.generate(ids, p, images=imgs) for (ids, imgs, _), p in zip(requests, params, strict=True))
    )
    return sum(len(o.output_ids) for o in outs), time.perf_counter() - start, outs


def summary(runs: list[dict]) -> dict:
    return {"runs": runs, "tok_s_median": round(statistics.median(r["tok_s"] for r in runs), 1)}


def warm_requests(requests) -> list:
    return [(i, imgs, 4) for i, imgs, _ in requests[:8]]


def embedded(path: Path, requests, args) -> tuple[dict, list]:
    from agentrl.engines.embedded import EmbeddedEngine

    cuda = args.device.startswith("cuda")
    engine = EmbeddedEngine(str(path), device=args.device, dtype=args.dtype, max_batch_size=len(requests),
                            max_seq_len=max(len(i) + m for i, _, m in requests) + 1, cuda_graphs=cuda,
                            attention="triton" if cuda else "sdpa", compile=cuda, decode_steps=8 if cuda else 1)  # fmt: skip

    async def go():
        try:
            return await eb.timed_runs(
                engine, serve, requests, warm_requests(requests), args.runs, "embedded_run"
            )
        finally:
            await engine.close()

    runs, outs = asyncio.run(go())
    return summary(runs), outs


def sglang(path: Path, requests, args) -> dict:
    result = eb.sglang_runs(path, requests, serve, warm_requests(requests), args.runs, SGLANG_FLAGS,
                            args.sglang_log)  # fmt: skip
    return {**summary(result.pop("runs")), **result}


def learner_deltas(learner, requests, outs, k: int) -> tuple[Any, list[float]]:
    """|engine - learner| log-prob of each sampled token of the first `k` replies (all concatenated), and each
    reply's first token's (prefill alone: no decode step yet). The pictures' spans come from `SPANS`."""
    import torch

    from agentrl.learners.batch import build_batch

    deltas, first = [], []
    for i, ((ids, imgs, _), out) in enumerate(zip(requests[:k], outs, strict=False)):
        traj = types.normalize(types.Trajectory(
            id=f"r{i}", prompt_ids=ids, response_ids=out.output_ids, logprobs=out.logprobs, images=imgs,
            image_spans=SPANS[i]))  # fmt: skip
        logp = learner.compute_logprobs(build_batch([traj], learner.pad_id, images=True))
        got = logp[0, len(ids) : len(ids) + len(out.output_ids)]
        delta = (got.float().cpu() - torch.tensor(out.logprobs)).abs()
        deltas.append(delta)
        first.append(float(delta[0]))
    return torch.cat(deltas), first


def logprob_check(path: Path, requests, outs, args, dtype: str = "float32") -> dict:
    """The torch learner's log-probs of K sampled responses (transformers' forward; `dtype`: the learner's, bf16
    being autocast on CUDA) against the engine's."""
    from agentrl.config.learning import LearnerSection
    from agentrl.learners.torch_learner import TorchLearner

    learner = TorchLearner(path, LearnerSection(micro_batch_tokens=4096, device=args.device, dtype=dtype))
    every, first = learner_deltas(learner, requests, outs, args.check_logprobs)
    return {
        "learner_dtype": dtype,
        "requests": len(first),
        "max": round(float(every.max()), 5),
        "mean": round(float(every.mean()), 5),
        "first_token_mean": round(sum(first) / len(first), 5),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["tiny", "qwen2.5-vl-3b"], default="qwen2.5-vl-3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-sglang", action="store_true", help="embedded engine only (CPU smoke)")
    ap.add_argument("--sglang-log", default="/tmp/sglang_vlm_server.log")
    ap.add_argument("--check-logprobs", type=int, default=0, metavar="K")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args.arch, Path(tmp), args.device)
        requests = make_requests(path, args)
        result: dict = {"arch": args.arch, "n": args.n, "image_size": args.image_size,
                        "image_tokens": SPANS[0][0].length, "prompt_len": args.prompt_len,
                        "output_len": args.output_len}  # fmt: skip
        result["embedded"], outs = embedded(path, requests, args)
        if args.check_logprobs:
            result["logprobs_vs_transformers"] = logprob_check(path, requests, outs, args)
            if args.device.startswith("cuda"):  # the engine's precision: bf16 rounding alone, or more?
                result["logprobs_vs_transformers_bf16"] = logprob_check(
                    path, requests, outs, args, "bfloat16"
                )
        if not args.no_sglang:
            result["sglang"] = sglang(path, requests, args)
            result["embedded_vs_sglang"] = round(
                result["embedded"]["tok_s_median"] / result["sglang"]["tok_s_median"], 3
            )
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
