"""How far apart are transformers' own float32 and bf16 log-probs on vlm_bench.py's random Qwen2.5-VL-3B?

    python bench/gpu/vlm_bf16_spread.py [--init-std 0.02] [--device cpu] [--tokens 200]   # one JSON line

The floor under any engine-vs-learner log-prob comparison on random weights: the same weights (drawn at
`--init-std`, then stored in bf16 as vlm_bench.py stores them), the same random text tokens (no picture), scored
by transformers in float32 and in bf16; mean, max and first-token |Δ log p|. At 0.1 (the tiny VLM's range) the
36 layers blow the logits up to ±25 and bf16 rounding alone moves log-probs by most of a nat; at 0.02 (a real
checkpoint's) it does not (docs/benchmarks/gpu.md §9). ~12 GB of memory for the float32 copy, minutes on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import vlm_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    from transformers import AutoModelForImageTextToText

    vlm_bench.QWEN25_VL_3B["initializer_range"] = args.init_std
    vlm_bench.QWEN25_VL_3B["vision_config"]["initializer_range"] = args.init_std
    with tempfile.TemporaryDirectory() as tmp:
        path = vlm_bench.build_model("qwen2.5-vl-3b", Path(tmp), args.device)
        torch.manual_seed(0)
        ids = torch.randint(100, 5000, (1, args.tokens), device=args.device)
        logp, peak = {}, {}
        for dtype in (torch.float32, torch.bfloat16):
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(args.device).eval()
            with torch.no_grad():
                logits = model(input_ids=ids).logits.float()
            logp[dtype] = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            peak[dtype] = logits.abs().max().item()
            del model
    d = (logp[torch.float32] - logp[torch.bfloat16]).abs()
    print(json.dumps({"init_std": args.init_std, "tokens": args.tokens, "mean": round(d.mean().item(), 4),
                      "max": round(d.max().item(), 4), "first": round(d[0].item(), 4),
                      "logit_absmax_fp32": round(peak[torch.float32], 2),
                      "logprob_mean_fp32": round(logp[torch.float32].mean().item(), 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
