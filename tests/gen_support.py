"""Test support for generator tests: a tiny local model and an engine that really runs it.

`engine_for(model_dir)` returns agentrl's embedded engine when it exists; until then `HFEngine`, a small
Engine implementation over the Hugging Face model (token-by-token forward, greedy or seeded sampling,
temperature-1 logprobs as the Engine contract defines them). `script` forces the tokens of a reply (the
logprobs are still the model's own for those tokens), to drive an env down a chosen path.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agentrl.engines.base import Engine, GenerateOutput, SamplingParams

torch.set_num_threads(1)


@functools.lru_cache(maxsize=2)
def tiny_model_dir(root: str, seed: int = 0) -> Path:
    from agentrl.engines.tiny import make_tiny_model

    path = Path(root) / f"tiny-{seed}"
    if not (path / "config.json").exists():
        make_tiny_model(path, arch="qwen2", seed=seed, hidden=32, layers=1, heads=2, kv_heads=1)
    return path


class HFEngine(Engine):
    def __init__(
        self, model_dir: Path, version: int = 0, script: Callable[[list[int]], list[int] | None] | None = None
    ):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.version = version
        self.script = script
        self.calls: list[list[int]] = []
        self.abort_after: int | None = None  # abort the next request after this many tokens (once)

    @torch.no_grad()
    def _logprobs(self, ids: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([ids])).logits[0, -1].float()
        return torch.log_softmax(logits, dim=-1)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> GenerateOutput:
        self.calls.append(list(input_ids))
        forced = self.script(list(input_ids)) if self.script else None
        gen = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else len(self.calls))
        ids, out, logprobs = list(input_ids), [], []
        finish = "length"
        limit = sampling.max_new_tokens
        for step in range(limit):
            if self.abort_after is not None and step == self.abort_after:
                self.abort_after = None
                finish = "abort"
                break
            lp = self._logprobs(ids)
            if forced is not None:
                if step >= len(forced):
                    finish = "stop"
                    break
                tok = forced[step]
            elif sampling.temperature <= 0:
                tok = int(lp.argmax())
            else:
                probs = torch.softmax(lp / sampling.temperature, dim=-1)
                tok = int(torch.multinomial(probs, 1, generator=gen))
            ids.append(tok)
            out.append(tok)
            logprobs.append(float(lp[tok]))
            await asyncio.sleep(0)
            if tok in sampling.stop_token_ids and not sampling.ignore_eos:
                finish = "stop"
                break
        versions = [(self.version, len(out))] if out else []
        return GenerateOutput(output_ids=out, logprobs=logprobs, finish_reason=finish, versions=versions,
                              prompt_tokens=len(input_ids))  # fmt: skip

    async def abort(self, request_id: str) -> None:
        pass

    async def pause(self, mode: Any = "keep") -> None:
        pass

    async def resume(self) -> None:
        pass

    async def update_weights(self, version: int, source: Any) -> None:
        self.version = version

    async def flush_cache(self) -> None:
        pass

    async def health(self) -> dict[str, Any]:
        return {"ok": True}

    @property
    def policy_version(self) -> int:
        return self.version


def real_model_logprob(model_dir: Path, context: list[int], token: int) -> float:
    """An independent check of one logprob: a fresh HF forward over `context`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1]
    return float(torch.log_softmax(logits, -1)[token])
