"""A timed workload served by one engine: the true-on-policy tests' requests, in process and through the
interpreted Triton kernels (tests/invariant_triton_checks.py)."""

from __future__ import annotations

import asyncio

import torch

from agentrl import types
from agentrl.engines.base import GenerateOutput, SamplingParams


def serve_workload(
    engine, workload: list[tuple[int, int, float]], temperature: float, vocab_size: int = 300
) -> list[tuple[list[int], GenerateOutput, types.Trajectory]]:
    """Each (prompt length, new tokens, arrival seconds) of `workload` is one request: seeded random prompt
    ids in [5, vocab_size) (the same prompts at every call), new tokens sampled at `temperature` with eos
    ignored, sent that many seconds after the first request. The engine is closed after. Returns each
    request's prompt, output and normalized trajectory, in workload order."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab_size, (n,), generator=gen).tolist() for n, _, _ in workload]

    async def one(prompt, new_tokens, delay_s):
        await asyncio.sleep(delay_s)
        sampling = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True)
        return await engine.generate(prompt, sampling)

    async def main():
        try:
            return await asyncio.gather(
                *(one(p, n, d) for p, (_, n, d) in zip(prompts, workload, strict=True))
            )
        finally:
            await engine.close()

    outs = asyncio.run(main())
    return [
        (p, o, types.normalize(types.Trajectory(id=f"t{i}", prompt_ids=p, response_ids=o.output_ids,
                                                logprobs=o.logprobs, versions=o.versions)))
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]  # fmt: skip
