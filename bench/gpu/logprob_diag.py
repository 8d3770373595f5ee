"""Which part of the embedded engine's GPU path moves its logprobs away from a teacher-forced HF forward.

    python3 bench/gpu/logprob_diag.py            # CUDA; prints one JSON line per configuration

The setup of tests/test_gpu_engine.py::test_graph_engine_logprobs_match_hf_across_update (tiny Qwen3, bf16,
5 prompts x 40 tokens; then every weight x 1.3, published in place), for several engine seeds (different
sampled tokens) per configuration: default; torch sampler; eager prefill; inductor emulating eager's bf16
rounding (`emulate_precision_casts`, now the engine's default: `fp32_casts` turns it off); no torch.compile.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

CONFIGS = {
    "default": {},
    "torch_sampler": {"sampler": "torch"},
    "eager_prefill": {"eager_prefill": True},
    "fp32_casts": {"compile_options": {}},
    "no_compile": {"compile": False},
}


def hf_logprobs(model, prompt, output):
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output, device="cuda")[:, None])[:, 0]


def measure(path: Path, seed: int, sampler="auto", eager_prefill=False, compile=None):
    from transformers import AutoModelForCausalLM

    from agentrl.engines.base import SamplingParams, TensorSource
    from agentrl.engines.embedded import EmbeddedEngine

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    engine = EmbeddedEngine(str(path), device="cuda", dtype="bfloat16", max_batch_size=16, max_seq_len=512,
                            seed=seed, sampler=sampler, compile=compile)  # fmt: skip
    engine.runner.model.compiled_prefill = not eager_prefill
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 40, 130, 9, 77))]
    sp = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)

    async def run():
        outs = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
        d = torch.cat([(torch.tensor(o.logprobs, device="cuda") - hf_logprobs(hf, p, o.output_ids)).abs()
                       for p, o in zip(prompts, outs, strict=True)])  # fmt: skip
        return float(d.mean())

    async def main():
        before = await run()
        with torch.no_grad():
            for p in hf.parameters():
                p.mul_(1.3)
        await engine.update_weights(1, TensorSource([(n, p.detach()) for n, p in hf.named_parameters()]))
        after = await run()
        await engine.close()
        return before, after

    return asyncio.run(main())


def main() -> None:
    from agentrl.engines import model
    from agentrl.engines.tiny import make_tiny_model

    root = Path(tempfile.mkdtemp())
    path = make_tiny_model(root / "m", arch="qwen3", hidden=256, layers=4, heads=8, kv_heads=4, seed=0)
    default_options = dict(model.COMPILE_OPTIONS)
    for name, opts in CONFIGS.items():
        opts = dict(opts)
        model.COMPILE_OPTIONS = opts.pop("compile_options", default_options)  # as bench/engine_bench.py
        torch._dynamo.reset()  # compiled code does not guard on inductor's options
        pairs = [measure(path, seed, **opts) for seed in range(3)]
        row = {"config": name, "mean_before": [round(a, 5) for a, _ in pairs],
               "mean_after": [round(b, 5) for _, b in pairs],
               "avg_after": round(statistics.mean(b for _, b in pairs), 5)}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
