"""Hot reload of a vision-language model into real SGLang, on every publish path, with the torch learner's own
publish stream (its checkpoint-file names: `visual.*`, `model.layers.*`).

    python3 bench/gpu/sglang_vlm_reload.py --out $OUT            # CUDA + SGLang; ~3 min on one H200
    python3 bench/gpu/sglang_vlm_reload.py --out $OUT --sglang-disable-fast-image-processor   # any SGLang flag
    python3 bench/gpu/sglang_vlm_reload.py --device cpu --arch tiny --no-sglang   # CPU smoke: the embedded
                                                    # engine in SGLang's place, the tensor and disk paths

A random Qwen2.5-VL-3B architecture (bench/gpu/vlm_bench.py's `build_model`, weights drawn at 0.02) served by
SGLang (agentrl's SGLangServer and SGLangEngine, pictures on /generate) and loaded by the torch learner (bf16
autocast, vision tower included). Each version perturbs part of the learner's weights (`all`, the vision tower
alone, the language model alone), publishes `learner.weights()` through one path (`tensor`: CUDA IPC;
`distributed` / `distributed_bucketed`: a gloo group, SGLang's NCCL-path API; `disk`: the HF directory the `disk`
path writes), then samples replies to prompts that each hold a picture. A version passes when SGLang stamps it on
every token and its log-probs match the learner's forward on the new weights (mean |Δ| <= --tol) clearly better
than the previous weights (mean |Δ| against those at least 3x larger): a vision-tower update SGLang skipped
would leave its pictures read by the old tower, and the second condition would fail. One JSON summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import vlm_bench

from agentrl.config.learning import LearnerSection
from agentrl.engines.base import DiskSource, SamplingParams
from agentrl.engines.sglang_launcher import SGLangServer, parse_sglang_flags, vision_server_env
from agentrl.learners.hf_io import save_hf_dir
from agentrl.learners.torch_learner import TorchLearner

VERSIONS = [  # (publish path, which weights change)
    ("tensor", "all"),
    ("distributed", "vision"),
    ("distributed_bucketed", "language"),
    ("disk", "vision"),
]
SGLANG_FLAGS = {**vlm_bench.SGLANG_FLAGS, "mem_fraction_static": 0.35}  # the learner shares the GPU


def perturb(model: torch.nn.Module, base: dict[str, torch.Tensor], part: str, seed: int) -> int:
    """sglang_check's perturbation (new weights at the drawn ones' scale) of the parameters of `part`: all, the
    vision tower (`model.visual.*`) or the language model; returns how many tensors changed."""
    import sglang_check

    def only(name: str) -> bool:
        return part == "all" or (".visual." in f".{name}") == (part == "vision")

    return sglang_check.perturb(model, base, seed, only)


def learner_logprobs(learner: TorchLearner, requests, outs, k: int) -> float:
    every, _ = vlm_bench.learner_deltas(learner, requests, outs, k)
    return round(float(every.mean()), 5)


async def serve(engine, requests) -> list:
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    return await asyncio.gather(*(engine.generate(ids, sp, images=imgs) for ids, imgs, _ in requests))


async def probe(engine, learner: TorchLearner, path: Path, args) -> list[dict]:
    """Mean |Δ| log-prob of the served replies against the learner before any publish, for each `--probe` entry:
    `text` (the prompts' text after the picture, alone), or a picture kind and size (`noise224`: uniform noise;
    `flat56`: one colour; `shapes56`: the shapes env's drawing), one picture per prompt: where the engine and
    the learner part, when they do."""
    rows = []
    for entry in args.probe:
        kind = entry.rstrip("0123456789") or "noise"
        size = int(entry[len(kind) :] or 56) if kind != "text" else 56
        if kind not in ("text", "noise", "flat", "shapes"):
            raise SystemExit(f"--probe {entry!r}: use text, noiseN, flatN or shapesN")
        requests = vlm_bench.make_requests(path, SimpleNamespace(
            seed=0, n=args.n, image_size=size, picture="noise" if kind == "text" else kind, prompt_len=(4, 16),
            output_len=(24, 24)))  # fmt: skip
        if kind == "text":
            start = [s[0].start + s[0].length for s in vlm_bench.SPANS]
            requests = [(ids[at:], [], m) for (ids, _, m), at in zip(requests, start, strict=True)]
            vlm_bench.SPANS[:] = [[] for _ in requests]
        outs = await serve(engine, requests)
        every, first = vlm_bench.learner_deltas(learner, requests, outs, args.n)
        row = {"probe": entry, "image_tokens": sum(s.length for sp in vlm_bench.SPANS for s in sp) // args.n,
               "mean": round(float(every.mean()), 5), "max": round(float(every.max()), 5),
               "first_token_mean": round(sum(first) / len(first), 5)}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


async def publish(engine, path_name: str, version: int, learner: TorchLearner, root: Path, args) -> dict:
    import sglang_check

    start = time.perf_counter()
    if path_name == "disk":  # what the learner actor's save_hf writes for the disk path
        target = save_hf_dir(root / f"v{version}", learner.weights(), learner.base_path)
        await engine.update_weights(version, DiskSource(str(target)))
        return {"seconds": round(time.perf_counter() - start, 3)}
    named = list(learner.weights())
    return await sglang_check.publish(engine, path_name, version, named, None, root, args)


async def check(args) -> dict:
    from agentrl.engines.sglang import SGLangEngine

    root = Path(args.workdir or tempfile.mkdtemp())
    path = vlm_bench.build_model(args.arch, root, args.device)
    learner = TorchLearner(
        path, LearnerSection(micro_batch_tokens=4096, device=args.device, dtype=args.dtype)
    )
    base = {n: p.detach().clone().float() for n, p in learner.model.named_parameters()}
    names = [n for n, _ in learner.weights()]
    result: dict = {"arch": args.arch, "requests": args.n, "published_tensors": len(names),
                    "vision_names": sum(n.startswith("visual.") for n in names), "checks": []}  # fmt: skip
    versions = VERSIONS
    if args.no_sglang:  # the script's own logic on a CPU: no distributed group without SGLang
        from agentrl.engines.embedded import EmbeddedEngine

        server, engine = None, EmbeddedEngine(str(path), device=args.device, max_batch_size=args.n)
        versions = [(p, part) for p, part in VERSIONS if not p.startswith("distributed")]
    else:
        flags = {**SGLANG_FLAGS, **args.sglang_flags}
        server = SGLangServer(str(path), args=flags, startup_timeout_s=600, restart_on_crash=False,
                              env=vision_server_env(vision_tower_trained=True),
                              log_path=str(Path(args.out) / "sglang_vlm_server.log"))  # fmt: skip
        await asyncio.to_thread(server.start)
        engine = SGLangEngine(server.url, update_timeout_s=300)
    try:
        if args.probe:  # version 0 alone, on pictures of several sizes and on text alone
            result["probe"] = await probe(engine, learner, path, args)
            return result
        requests = vlm_bench.make_requests(path, SimpleNamespace(
            seed=0, n=args.n, image_size=args.image_size, prompt_len=(4, 16), output_len=(24, 24)))  # fmt: skip
        outs = await serve(engine, requests)
        first = learner_logprobs(learner, requests, outs, args.n)
        result["checks"].append({"version": 0, "mean": first, "ok": first <= args.tol})
        for version, (path_name, part) in enumerate(versions, start=1):
            previous = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
            changed = perturb(learner.model, base, part, version)
            timing = await publish(engine, path_name, version, learner, root, args)
            outs = await serve(engine, requests)
            row = {"version": version, "path": path_name, "changed": part, "tensors_changed": changed, **timing,
                   "stamped": all(o.versions == [(version, len(o.output_ids))] for o in outs),
                   "mean": learner_logprobs(learner, requests, outs, args.n)}  # fmt: skip
            with torch.no_grad():
                for n, p in learner.model.named_parameters():
                    p.copy_(previous[n])
            row["mean_vs_previous"] = learner_logprobs(learner, requests, outs, args.n)
            del previous
            perturb(learner.model, base, part, version)  # the same draw again: the new weights back
            row["ok"] = (
                row["stamped"] and row["mean"] <= args.tol and row["mean_vs_previous"] >= 3 * row["mean"]
            )
            result["checks"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        await engine.close()
        if server is not None:
            await asyncio.to_thread(server.stop)
    result["all_ok"] = all(c["ok"] for c in result["checks"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/sglang_vlm_reload")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--arch", choices=["tiny", "qwen2.5-vl-3b"], default="qwen2.5-vl-3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="the learner's (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--n", type=int, default=4, help="prompts, each with one picture")
    ap.add_argument("--tol", type=float, default=0.1, help="mean |Δ| log-prob against the new weights")
    ap.add_argument(
        "--image-size", type=int, default=224, help="pixels square (56: no resize, 4 image tokens)"
    )
    ap.add_argument(
        "--probe",
        type=lambda text: text.split(","),
        default=None,
        help="comma-separated: text, noiseN, flatN, shapesN (N pixels square): version 0's log-prob gap "
        "for each, then stop",
    )
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument("--dist-backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--bucket-mb", type=int, default=256)
    sglang_flags, rest = parse_sglang_flags(
        sys.argv[1:]
    )  # --sglang-<flag> [VALUE], as `agentrl run` takes them
    args = ap.parse_args(rest)
    args.sglang_flags = sglang_flags
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = asyncio.run(check(args))
    print(json.dumps(result))
    (Path(args.out) / "sglang_vlm_reload.json").write_text(json.dumps(result, indent=1))
    sys.exit(0 if result.get("all_ok", True) else 1)


if __name__ == "__main__":
    main()
