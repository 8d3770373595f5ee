"""Mixture-of-experts models through real SGLang: routed experts for rollout routing replay, and hot reload.

    python3 bench/gpu/moe_sglang_check.py --out $OUT [--arch qwen3-30b-a3b-4l|glm45-air-3l] [--sglang-<flag> ...]

Writes a random-init MoE HF directory (Qwen3-30B-A3B's layer shape with 4 layers, or GLM-4.5-Air's with 3: one
dense, two MoE), launches SGLang with `--enable-return-routed-experts` through `SGLangServer`, and samples
through `SGLangEngine` with `return_routed_experts`. For every request it checks the record's shape (prompt +
output - 1 positions, the model's MoE layers, top-k), then compares with transformers (bf16, same GPU):
`router_agreement` (share of token x MoE-layer choices where transformers' own top-k set equals SGLang's),
and the sampled tokens' log-prob mismatch mean |d| with transformers routing itself and with SGLang's experts
replayed into it (agentrl.learners.routing_replay, what the torch learner does under `learner.routing_replay =
"rollout"`). Then it publishes perturbed weights by the tensor and disk paths (experts under the per-expert
names SGLang loads, agentrl.engines.weight_sync.per_expert_names) and checks the new version's log-probs follow
them. Prints one JSON line per check and a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from agentrl.engines.base import DiskSource, SamplingParams, TensorSource
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_launcher import SGLangServer, parse_sglang_flags
from agentrl.engines.weight_sync import per_expert_names
from agentrl.learners.routing_replay import Routers
from agentrl.types import routed_expert_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_bench import MOE_ARCHS, build_model  # bench/: the one builder of random models

DEFAULT_FLAGS = [
    "--sglang-attention-backend", "triton", "--sglang-sampling-backend", "pytorch",
    "--sglang-grammar-backend", "none", "--sglang-disable-piecewise-cuda-graph",
    "--sglang-skip-server-warmup", "--sglang-skip-tokenizer-init", "--sglang-mem-fraction-static", "0.5",
    "--sglang-enable-return-routed-experts",
]  # fmt: skip
TOL = 1e-2  # mean |d| of log-probs after a publish, as sglang_check.py (bf16)


def forward_logprobs(model, routers: Routers, ids: list[int], n_prompt: int, output: list[int],
                     record: torch.Tensor | None) -> tuple[torch.Tensor, float, int]:  # fmt: skip
    """transformers' log-probs of `output` after `ids[:n_prompt]`, routing itself (record None) or replaying
    `record` ([positions, layers, topk]); with a record also the agreement count of its own top-k with it."""
    x = torch.tensor([ids], device=model.device)
    records = None
    if record is not None:
        records = torch.full(
            (1, len(ids), routers.layers, routers.topk), -1, dtype=torch.long, device=x.device
        )
        records[0, : record.shape[0]] = record
    tokens = torch.ones_like(x, dtype=torch.float32)
    agree = torch.zeros_like(x, dtype=torch.bool)
    agree[0, : len(ids) - 1] = True
    with torch.inference_mode(), routers.routing(records, tokens=tokens, agree_positions=agree) as state:
        logits = model(input_ids=x).logits[0, n_prompt - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(output, device=x.device)[:, None])[:, 0]
    matches = sum(int(v) for v in state.matches.values())
    choices = sum(int(v) for v in state.choices.values())
    return lp, matches, choices


async def sample_and_compare(engine: SGLangEngine, model, routers: Routers, prompts, version: int) -> dict:
    sp = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True, return_routed_experts=True)
    outs = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
    own, replayed, shapes_ok, matches, choices = [], [], True, 0, 0
    for p, o in zip(prompts, outs, strict=True):
        ids = p + o.output_ids
        rec = o.routed_experts
        arr = routed_expert_ids(rec) if rec is not None else None
        shapes_ok &= arr is not None and arr.shape == (len(ids) - 1, routers.layers, routers.topk)
        got = torch.tensor(o.logprobs, device=model.device)
        lp_own, _, _ = forward_logprobs(model, routers, ids, len(p), o.output_ids, None)
        own.append((got - lp_own).abs())
        if arr is not None:
            record = torch.from_numpy(arr.astype("int64")).to(model.device)
            lp_rep, m, c = forward_logprobs(model, routers, ids, len(p), o.output_ids, record)
            replayed.append((got - lp_rep).abs())
            matches, choices = matches + m, choices + c
    d_own = torch.cat(own)
    row = {
        "version": version,
        "records_ok": bool(shapes_ok),
        "router_agreement": round(matches / max(choices, 1), 4),
        "mismatch_mean_no_replay": round(float(d_own.mean()), 5),
        "mismatch_max_no_replay": round(float(d_own.max()), 4),
        "tokens": int(d_own.numel()),
    }
    if replayed:
        d_rep = torch.cat(replayed)
        row.update(
            mismatch_mean_replay=round(float(d_rep.mean()), 5),
            mismatch_max_replay=round(float(d_rep.max()), 4),
        )
    row["ok"] = row["records_ok"] and row.get("mismatch_mean_replay", 1.0) <= TOL
    return row


def perturb(model, seed: int) -> None:
    """New weights at the scale of the current ones (0.8 w + 0.6 std(w) noise for matrices), fp32 biases kept."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
                p.copy_(0.8 * p.float() + 0.6 * p.float().std() * noise)


async def main_async(args, flags: dict) -> dict:
    from transformers import AutoModelForCausalLM

    out, root = Path(args.out), Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = build_model(args.arch, root, "bfloat16", "cuda")
    server = SGLangServer(str(path), args=flags, log_path=str(out / f"sglang_{args.arch}.log"),
                          startup_timeout_s=600, restart_on_crash=False)  # fmt: skip
    await asyncio.to_thread(server.start)
    result: dict = {"arch": args.arch, "startup_s": round(time.perf_counter() - t0, 1), "checks": []}
    engine = SGLangEngine(server.url, update_timeout_s=300, model_path=str(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda:0").eval()
    routers = Routers(model)
    result["moe_layers"], result["topk"], result["experts"] = (
        routers.layers,
        routers.topk,
        routers.num_experts,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(model.config.vocab_size, (n,), generator=g).tolist() for n in (16, 32, 64, 128) * 4
    ]
    try:
        result["checks"].append(
            {"path": "initial", **await sample_and_compare(engine, model, routers, prompts, 0)}
        )
        print(json.dumps(result["checks"][-1]), flush=True)
        for version, name in enumerate(args.paths.split(","), start=1):
            perturb(model, version)
            start = time.perf_counter()
            if name == "tensor":
                named = per_expert_names((n, p.detach()) for n, p in model.named_parameters())
                await engine.update_weights(version, TensorSource(list(named)))
            else:
                target = root / f"v{version}"
                model.save_pretrained(target, safe_serialization=True)
                await engine.update_weights(version, DiskSource(str(target)))
            publish_s = round(time.perf_counter() - start, 3)
            check = await sample_and_compare(engine, model, routers, prompts, version)
            result["checks"].append({"path": name, "publish_s": publish_s, **check})
            print(json.dumps(result["checks"][-1]), flush=True)
    finally:
        await engine.close()
        await asyncio.to_thread(server.stop)
    result["all_ok"] = all(c["ok"] for c in result["checks"])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/out")
    parser.add_argument("--workdir", default="/tmp/moe_sglang_check")
    parser.add_argument("--arch", choices=sorted(MOE_ARCHS), default="qwen3-30b-a3b-4l")
    parser.add_argument("--paths", default="tensor,disk", help="publish paths, in order (tensor, disk)")
    args, rest = parser.parse_known_args()
    flags, extra = parse_sglang_flags(DEFAULT_FLAGS + rest)
    if extra:
        parser.error(f"unknown arguments: {extra}")
    result = asyncio.run(main_async(args, flags))
    print(json.dumps({"summary": result}), flush=True)
    Path(args.out, f"moe_sglang_{args.arch}.json").write_text(json.dumps(result, indent=1))
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
