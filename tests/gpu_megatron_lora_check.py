"""Megatron LoRA vs torch + peft LoRA on GPUs (fp32, TF32 off); run directly (1 GPU) or under torchrun (TP = 2).

    python3 tests/gpu_megatron_lora_check.py MODEL_DIR
    torchrun --standalone --nproc_per_node 2 tests/gpu_megatron_lora_check.py MODEL_DIR --tp 2

From the same adapter, one GRPO step with a KL term (reference = adapter disabled), for all-linear and for a
subset of targets: log-probs, reference log-probs, loss, KL, grad norm, the updated adapter, the published
adapter and the merged weights of the two learners (megatron_lora_helpers.compare). Prints one JSON line from
rank 0 with "ok" (every difference <= 1e-4; grad norm <= 1e-3).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: agentrl and the tests package

import torch


def ok(out: dict) -> bool:
    diffs = [out[k] for k in ("logprob_diff", "ref_logprob_diff", "adapter_diff", "published_diff", "merged_diff",
                              "after_logprob_diff")]  # fmt: skip
    metrics = out["metrics"]
    close = all(abs(a - b) <= (1e-3 if k == "grad_norm" else 1e-4) for k, (a, b) in metrics.items())
    return max(diffs) <= 1e-4 and close and out["adapter_moved"] > 1e-3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import torch.distributed as dist

    from agentrl.config.learning import AlgorithmSection, LearnerSection
    from agentrl.learners.megatron.learner import MegatronLearner
    from tests.megatron_lora_helpers import ALGO, SETTINGS, compare, lora_section, torch_learner

    results = {}
    for targets in (("all-linear",), ("q_proj", "v_proj", "up_proj", "down_proj")):
        lc = LearnerSection(kind="megatron", device="cuda", tensor_parallel=args.tp, lora=lora_section(targets),
                            **SETTINGS)  # fmt: skip
        mega = MegatronLearner(args.model_dir, lc, AlgorithmSection(**ALGO))
        ref = torch_learner(args.model_dir, targets, device="cuda")
        results[",".join(targets)] = compare(mega, ref, mega.arch.vocab_size)
    if dist.get_rank() == 0:
        print(
            json.dumps({"ok": all(map(ok, results.values())), "tp": args.tp, "results": results}), flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
