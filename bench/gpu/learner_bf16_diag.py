"""Where does the torch learner's bfloat16 forward move log-probs away from its float32 one?

    python3 bench/gpu/learner_bf16_diag.py [--device cuda] [--warmup-steps 150]     # one JSON line per variant

The quickstart's tiny model, warmed up in float32 on the calculator demonstrations (`--warmup-steps`), then
the same right-padded batches (demonstrations, and replies sampled from the float32 model at temperature 1, as
the engine samples) scored by `compute_logprobs` in float32 and in bfloat16 variants: autocast as the learner
runs it (`learner.dtype = "bfloat16"`), autocast with eager attention instead of SDPA, and the weights cast to
bfloat16 (the engine's precision). Per variant: mean and max |Δ log p| over loss tokens, the share above 1 nat,
and the five largest with their row, column and the row's length (is it where padding or a turn starts?).
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


if __name__ == "__main__":
    main()
