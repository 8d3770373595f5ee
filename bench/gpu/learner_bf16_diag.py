"""Where does the torch learner's bfloat16 forward move log-probs away from its float32 one?

    python3 bench/gpu/learner_bf16_diag.py [--device cuda] [--warmup-steps 150]     # one JSON line per variant

The quickstart's tiny model, warmed up in float32 on the calculator demonstrations (`--warmup-steps`), then
the same right-padded batches (demonstrations, and replies sampled from the float32 model at temperature 1, as
the engine samples) scored by `compute_logprobs` in float32 and in bfloat16 variants: autocast as the learner
runs it (`learner.dtype = "bfloat16"`), autocast with eager attention instead of SDPA, and the weights cast to
bfloat16 (the engine's precision). Per variant: mean and max |Δ log p| over loss tokens, the share above 1 nat,
and the five largest with their row, column and the row's length (is it where padding or a turn starts?).
Then the backward: the gradient of the demonstrations' SFT loss (and of a sampled batch's) under each variant
against float32's (cosine and relative error, over all weights and for the worst weight), and a race: the
warm-up from one fresh model in float32 and in bfloat16 (`learner.dtype`), same batches, its loss every 10
steps (`--race-steps`): does bfloat16 SFT descend as fast per step?
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument("--model", default="runs/tiny-model-diag")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--race-steps", type=int, default=250)
    args = ap.parse_args()

    from agentrl.actors.learner import make_learner
    from agentrl.actors.warmup import Warmup, demonstration_batch
    from agentrl.config import load_config
    from agentrl.engines.tiny import make_tiny_model
    from agentrl.learners.batch import build_batch
    from agentrl.tokenizer import load_tokenizer
    from agentrl.types import Trajectory, pack_tokens
    from agentrl.types.trajectory import TOKEN_DTYPE

    if not (Path(args.model) / "config.json").is_file():
        make_tiny_model(args.model)
    cfg = load_config(
        "examples/quickstart.toml", ["--model.path", args.model, "--learner.device", args.device]
    )
    learner = make_learner(cfg, args.model)
    tok = load_tokenizer(args.model)
    warm = Warmup(cfg, learner, tok, learner.pad_id)
    warm.advance(args.warmup_steps)
    print(
        json.dumps({"warmup_steps": len(warm.losses), "warmup_loss": sum(warm.losses[-5:]) / 5}), flush=True
    )

    demos = demonstration_batch(cfg, warm.env, tok, warm.tasks.next_batch(64), "diag")
    # replies sampled from the fp32 model (temperature 1), continuing each demonstration's prompt
    model = learner.model
    sampled = []
    gen = torch.Generator(device=args.device).manual_seed(0)
    with torch.no_grad():
        for d in demos[: args.samples // 4]:
            prompt = torch.tensor(
                np.frombuffer(d.prompt_ids, dtype=TOKEN_DTYPE).astype(np.int64), device=args.device
            )
            prompt = prompt[None]
            for _ in range(4):
                ids = prompt
                for _ in range(24):
                    logits = model(input_ids=ids).logits[:, -1].float()
                    nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
                    ids = torch.cat([ids, nxt], 1)
                resp = ids[0, prompt.shape[1] :].tolist()
                sampled.append(
                    Trajectory(
                        id=f"s{len(sampled)}",
                        prompt_ids=d.prompt_ids,
                        response_ids=pack_tokens(resp),
                        loss_mask=np.ones(len(resp), dtype=np.uint8).tobytes(),
                    )
                )
    # mixed: rows of two lengths, so right padding and its mask are in play
    batches = {"demonstrations": demos, "sampled": sampled, "mixed": demos[:32] + sampled[:32]}

    @contextlib.contextmanager
    def variant(name):
        saved = (learner._autocast, model.config._attn_implementation)
        try:
            if name.startswith("autocast"):
                dev = learner.device.type
                learner._autocast = lambda m: torch.autocast(dev, dtype=torch.bfloat16)
            if name == "autocast_eager":
                model.set_attn_implementation("eager")
            yield
        finally:
            learner._autocast = saved[0]
            model.set_attn_implementation(saved[1])

    for bname, trajs in batches.items():
        batch = build_batch(trajs, learner.pad_id, args.device)
        mask = batch.loss_mask.bool().to(args.device)
        ref = learner.compute_logprobs(batch)
        for name in ("autocast", "autocast_eager", "weights_bf16"):
            if name == "weights_bf16":
                state = {k: v.clone() for k, v in model.state_dict().items()}
                model.to(torch.bfloat16)
                got = learner.compute_logprobs(batch)
                model.to(torch.float32)
                model.load_state_dict(state)
            else:
                with variant(name):
                    got = learner.compute_logprobs(batch)
            d = (got - ref).abs()[mask]
            full = (got - ref).abs() * mask
            top = torch.topk(full.flatten(), 5)
            width = full.shape[1]
            lengths = batch.attention_mask.sum(1).tolist()
            worst = [
                {
                    "row": int(i // width),
                    "col": int(i % width),
                    "len": int(lengths[int(i // width)]),
                    "d": round(float(v), 3),
                    "ref": round(float(ref.flatten()[i]), 3),
                }
                for v, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)
            ]
            print(json.dumps({"batch": bname, "variant": name, "tokens": int(mask.sum()),
                              "mean": round(float(d.mean()), 5), "max": round(float(d.max()), 4),
                              "frac_gt_1nat": round(float((d > 1).float().mean()), 5), "worst": worst}), flush=True)  # fmt: skip

    def sft_grads(batch) -> dict[str, torch.Tensor]:
        """The gradient of the mean -log p over the batch's loss tokens, as the learner's forward computes it."""
        model.zero_grad(set_to_none=True)
        model.train()
        for mb in learner._split(batch):
            logp, _, _ = learner._forward(model, mb[1])
            m = mb[1].loss_mask.to(args.device).float()
            (-(logp * m).sum() / batch.loss_mask.sum()).backward()
        model.eval()
        return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}

    for bname in ("demonstrations", "sampled"):
        batch = build_batch(batches[bname], learner.pad_id, args.device)
        ref = sft_grads(batch)
        for name in ("autocast", "autocast_eager"):
            with variant(name):
                got = sft_grads(batch)
            flat_r = torch.cat([g.flatten() for g in ref.values()])
            flat_g = torch.cat([got[n].flatten() for n in ref])
            per = {n: (float(torch.nn.functional.cosine_similarity(got[n].flatten(), g.flatten(), dim=0)),
                       float((got[n] - g).norm() / g.norm().clamp_min(1e-30))) for n, g in ref.items()}  # fmt: skip
            worst = sorted(per.items(), key=lambda kv: kv[1][0])[:3]
            print(json.dumps({"grads": bname, "variant": name,
                              "cosine": round(float(torch.nn.functional.cosine_similarity(flat_g, flat_r, dim=0)), 6),
                              "rel_err": round(float((flat_g - flat_r).norm() / flat_r.norm()), 5),
                              "worst": [{"weight": n, "cosine": round(c, 4), "rel_err": round(e, 4)} for n, (c, e) in worst]}), flush=True)  # fmt: skip

    # the race: one fresh model, warmed up in float32 and in bfloat16 on the same batches
    curves = {}
    for dtype in ("float32", "bfloat16"):
        if dtype == "bfloat16" and args.device == "cpu":
            continue  # the learner refuses bf16 on a CPU (its bf16 is CUDA autocast)
        fresh = Path(f"{args.model}-race")
        if not (fresh / "config.json").is_file():
            make_tiny_model(str(fresh))
        rcfg = load_config("examples/quickstart.toml", ["--model.path", str(fresh), "--learner.device", args.device,
                                                      "--learner.dtype", dtype])  # fmt: skip
        racer = make_learner(rcfg, str(fresh))
        race = Warmup(rcfg, racer, load_tokenizer(str(fresh)), racer.pad_id)
        race.advance(args.race_steps)
        curves[dtype] = [round(sum(race.losses[i : i + 10]) / 10, 4) for i in range(0, len(race.losses), 10)]
        print(
            json.dumps({"race": dtype, "steps": len(race.losses), "loss_per_10_steps": curves[dtype]}),
            flush=True,
        )


if __name__ == "__main__":
    main()
