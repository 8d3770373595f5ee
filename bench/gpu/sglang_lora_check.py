"""LoRA versions hot-loaded into a real SGLang server through agentrl's adapter (a GPU check).

    python3 bench/gpu/sglang_lora_check.py --out $OUT [--versions 3] [--rank 16] [--sglang-<flag> VALUE ...]

Writes a random-init Qwen3-0.6B-architecture HF directory, launches SGLang through `SGLangServer` with the flags
`lora_server_args` gives (`--enable-lora --max-lora-rank R --lora-target-modules all`), builds the torch learner
with `[learner.lora]` (peft, all-linear) on the same GPU, and for versions 1..N: sets a fresh random adapter
(B != 0, large enough to move the log-probs), writes it with `save_adapter_dir`, publishes it with
`SGLangEngine.update_weights(v, AdapterSource)` (`/load_lora_adapter` under the name agentrl-v{v}, the previous
one unloaded after its requests) and samples. Every version must stamp each token with v, and SGLang's
log-probs of the sampled tokens must match the learner's (`compute_logprobs`, fp32) to a mean |d| <=
1e-2, and differ from the previous version's by more than 3x that difference. Prints one JSON line per version
and a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from sglang_check import DEFAULT_FLAGS, TOL, build_model

from agentrl import types
from agentrl.config.learning import AlgorithmSection, LearnerSection, LoraSection
from agentrl.engines.base import AdapterSource, SamplingParams
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_launcher import SGLangServer, lora_server_args, parse_sglang_flags
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner


def learner_logprobs(learner: TorchLearner, prompt: list[int], output: list[int]) -> torch.Tensor:
    t = types.normalize(
        types.Trajectory(id="x", group_id="x", prompt_ids=prompt, response_ids=output, reward=0.0)
    )
    logp = learner.compute_logprobs(build_batch([t], learner.pad_id, "cuda"))
    return logp[0, len(prompt) : len(prompt) + len(output)].float().cpu()


def randomize_adapter(learner: TorchLearner, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:  # |B·A·x| comparable to the base's outputs: a clearly different policy
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * 0.05)


async def sample(engine, learner, prompts, version: int, previous=None) -> dict:
    sp = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)
    outs = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
    diffs, stamped = [], []
    for p, o in zip(prompts, outs, strict=True):
        diffs.append((torch.tensor(o.logprobs) - learner_logprobs(learner, p, o.output_ids)).abs())
        stamped.append(o.versions == [(version, len(o.output_ids))])
    d = torch.cat(diffs)
    row = {"version": version, "versions_ok": all(stamped), "tokens": int(d.numel()),
           "logprob_mean_abs_diff": round(float(d.mean()), 5), "logprob_max_abs_diff": round(float(d.max()), 5)}  # fmt: skip
    if previous is not None:  # the same tokens scored by the previous version's learner state
        row["vs_previous_mean_abs_diff"] = round(float(torch.cat(previous(outs, prompts)).mean()), 4)
    row["ok"] = row["versions_ok"] and row["logprob_mean_abs_diff"] <= TOL
    if previous is not None:  # the new adapter is served: the previous version is 3x further than the noise
        row["ok"] = row["ok"] and row["vs_previous_mean_abs_diff"] > 3 * row["logprob_mean_abs_diff"]
    return row


async def main_async(args, flags: dict) -> dict:
    out, root = Path(args.out), Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    path = build_model(root)
    lora = LoraSection(rank=args.rank, alpha=2.0 * args.rank, target_modules=["all-linear"])
    server = SGLangServer(str(path), args={**lora_server_args(lora), **flags}, log_path=str(out / "sglang_lora.log"),
                          startup_timeout_s=600, restart_on_crash=False)  # fmt: skip
    t0 = time.perf_counter()
    await asyncio.to_thread(server.start)
    result: dict = {"startup_s": round(time.perf_counter() - t0, 1), "flags": server.argv[3:], "checks": []}
    engine = SGLangEngine(server.url, update_timeout_s=300)
    torch.backends.cuda.matmul.allow_tf32 = (
        False  # the learner is the fp32 reference of SGLang's bf16 serving
    )
    lc = LearnerSection(device="cuda", dtype="float32", lora=lora)
    learner = TorchLearner(path, lc, AlgorithmSection(advantage="rloo"))
    g = torch.Generator().manual_seed(0)
    vocab = learner.model.config.vocab_size
    prompts = [torch.randint(vocab, (n,), generator=g).tolist() for n in (16, 32, 64, 128)]
    try:
        with learner.model.disable_adapter():  # before any adapter: the base
            result["checks"].append({"stage": "base", **await sample(engine, learner, prompts, 0)})
        for version in range(1, args.versions + 1):
            before = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" in n}

            def previous(outs, prompts, before=before):
                now = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" in n}
                _set(learner, before)
                d = [(torch.tensor(o.logprobs) - learner_logprobs(learner, p, o.output_ids)).abs()
                     for p, o in zip(prompts, outs, strict=True)]  # fmt: skip
                _set(learner, now)
                return d

            randomize_adapter(learner, version)
            start = time.perf_counter()
            learner.save_adapter_dir(str(root / f"lora_v{version}"))
            saved = time.perf_counter()
            await engine.update_weights(version, AdapterSource(str(root / f"lora_v{version}")))
            timing = {"save_s": round(saved - start, 3), "load_s": round(time.perf_counter() - saved, 3)}
            row = {
                "stage": f"v{version}",
                **timing,
                **await sample(engine, learner, prompts, version, previous),
            }
            result["checks"].append(row)
            print(json.dumps(row), flush=True)
        await asyncio.sleep(1.0)  # the last unload runs after its version's requests
        result["loaded_at_end"] = engine._lora.current[0] if engine._lora.current else None
    finally:
        await engine.close()
        await asyncio.to_thread(server.stop)
    result["all_ok"] = all(c["ok"] for c in result["checks"])
    return result


def _set(learner: TorchLearner, values: dict) -> None:
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if name in values:
                p.copy_(values[name])


def main() -> None:
    flags, rest = parse_sglang_flags(DEFAULT_FLAGS + sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sglang_lora_check"))
    ap.add_argument("--workdir", default="/tmp/agentrl_sglang_lora_check")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args(rest)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = asyncio.run(main_async(args, flags))
    (Path(args.out) / "sglang_lora_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"all_ok": result["all_ok"], "checks": result["checks"]}), flush=True)
    sys.exit(0 if result["all_ok"] else 1)


if __name__ == "__main__":
    main()
