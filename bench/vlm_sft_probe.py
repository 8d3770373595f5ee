"""Can the tiny vision-language model read a `shapes` picture at all? Supervised training on the answer alone,
no RL and no agentrl run: the answer's first token after the prompt (its picture and question), cross-entropy over
the whole vocabulary, AdamW; every `--eval-every` steps the accuracy of the greedy first token on 128 held-out
tasks (the four answers are told apart by their first token). Chance is 1 / the number of answers.

    python bench/vlm_sft_probe.py [--question count|color] [--size 112] [--radius 8 14] [--max-shapes 4] \\
        [--lr 3e-3] [--steps 150] [--frozen-tower] [--blank]

`--blank`: zero pixels instead of the picture (what the model learns without seeing: the answers' prior).
`--frozen-tower`: the vision tower keeps its random weights. One JSON line per evaluation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from agentrl import types
from agentrl.chat import chat_tokens
from agentrl.engines.tiny import make_tiny_model
from agentrl.envs.shapes import COLORS, ShapesEnv
from agentrl.tokenizer import load_tokenizer
from agentrl.vision import VisionSpec, image_pixels


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--question", choices=["count", "color"], default="count")
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--radius", type=int, nargs=2, default=[8, 14])
    ap.add_argument("--max-shapes", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--frozen-tower", action="store_true")
    ap.add_argument("--blank", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(args.seed)
    path = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-vlm", arch="qwen2_5_vl", seed=args.seed)
    chat, spec = chat_tokens(load_tokenizer(path)), VisionSpec.from_dir(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    env = ShapesEnv(
        size=args.size, question=args.question, max_shapes=args.max_shapes, radius=tuple(args.radius)
    )
    answers = [str(n) for n in range(1, args.max_shapes + 1)] if args.question == "count" else list(COLORS)
    tok = load_tokenizer(path)
    first = torch.tensor([tok.encode(a)[0] for a in answers])
    assert len(set(first.tolist())) == len(answers), "two answers share their first token"

    def batch(tasks):
        rows, pixels, grids = [], [], []
        for task in tasks:
            opening = env.opening(task)
            ids, _ = chat.place_images(chat.prompt_ids(opening), opening)
            values, grid = image_pixels(path, types.message_images(opening)[0])
            rows.append(ids)
            pixels.append(torch.from_numpy(values))
            grids.append(grid)
        width = max(len(r) for r in rows)  # left-padded: every row's last position predicts the answer
        ids = torch.full((len(rows), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
        values = torch.cat(pixels)
        y = first[[answers.index(t["answer"]) for t in tasks]]
        return ids, mask, torch.zeros_like(values) if args.blank else values, torch.tensor(grids), y

    def last_logits(b):
        ids, mask, values, grids, _ = b
        out = model(input_ids=ids, attention_mask=mask, pixel_values=values, image_grid_thw=grids,
                    mm_token_type_ids=(ids == spec.image_token_id).int())  # fmt: skip
        return out.logits[:, -1]

    if args.frozen_tower:
        for name, p in model.named_parameters():
            if ".visual." in f".{name}":
                p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    held_out = batch(env.sample_tasks(999, 128))
    out, start, loss = [], time.perf_counter(), None
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():
                acc = (last_logits(held_out).argmax(-1) == held_out[4]).float().mean().item()
            out.append({"step": step, "accuracy": round(acc, 3), "loss": None if loss is None else round(loss, 3),
                        "s": round(time.perf_counter() - start, 1)})  # fmt: skip
            print(json.dumps(out[-1]), flush=True)
        if step == args.steps:
            break
        b = batch(env.sample_tasks(1 + step, args.batch_size))
        loss_t = torch.nn.functional.cross_entropy(last_logits(b), b[4])
        opt.zero_grad()
        loss_t.backward()
        opt.step()
        loss = loss_t.item()
    return out


if __name__ == "__main__":
    main()
