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
        if forced is not None:  # a continued (aborted) reply: skip the part already in the input
            done = next((k for k in range(len(forced), 0, -1) if input_ids[-k:] == forced[:k]), 0)
            forced = forced[done:]
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


def sft_on_demonstrations(model_dir: Path, out_dir: Path, env_name: str, steps: int, batch_size: int = 32,
                          lr: float = 3e-3, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """Supervised training on env demonstrations tokenized by `agentrl.chat.demonstration_tokens`
    (loss on assistant tokens only); saves the model to `out_dir`. Returns the first and last losses."""
    from transformers import AutoModelForCausalLM

    from agentrl.chat import demonstration_tokens
    from agentrl.envs import make_env
    from agentrl.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    env = make_env(env_name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        rows = []
        for task in env.sample_tasks(seed * 100_000 + step, batch_size):
            prompt, response, mask = demonstration_tokens(tok, env.demonstration(task))
            rows.append((prompt + response, [0] * len(prompt) + mask))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r, _ in rows])
        lab_mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.bool)
        logits = model(ids).logits[:, :-1]
        target, keep = ids[:, 1:], lab_mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[keep], target[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return {"first_loss": losses[0], "last_loss": losses[-1]}


def scripted_replies(model_dir: Path, tok: Any, *texts: str) -> HFEngine:
    """An HFEngine whose successive replies are exactly `texts`, each closed by the chat's end-of-turn token
    (a tool call the random tiny model would never write)."""
    from agentrl.chat import chat_tokens

    eot = chat_tokens(tok).eot_id
    replies = iter([[*tok.encode(t, add_special_tokens=False), eot] for t in texts])
    return HFEngine(model_dir, script=lambda _input: next(replies))


def record_sampling(engine: Any) -> list[tuple[float, float]]:
    """Wrap `engine.generate` so each request's (temperature, top_p) is appended to the returned list: what the
    proxy actually sampled with."""
    seen: list[tuple[float, float]] = []
    generate = engine.generate

    async def spy(input_ids, sampling, request_id=None):
        seen.append((sampling.temperature, sampling.top_p))
        return await generate(input_ids, sampling, request_id)

    engine.generate = spy
    return seen


def calculator_context(engine: Engine, model_dir: Path, max_new_tokens: int, max_seq_len: int) -> Any:
    """A greedy two-turn calculator `RolloutContext` for the multi_turn generator (the abort-path checks)."""
    from agentrl.envs import env_factory
    from agentrl.generator import RolloutContext
    from agentrl.tokenizer import load_tokenizer

    return RolloutContext(
        engine=engine, tokenizer=load_tokenizer(model_dir), make_env=env_factory("calculator", None),
        env_name="calculator", sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
        max_turns=2, max_seq_len=max_seq_len,
    )  # fmt: skip


class Recording(Engine):
    """Wraps a real engine, records every request's input ids, and can run a hook before a given call."""

    def __init__(self, inner: Engine, before_call: dict[int, Callable[[Engine], Any]] | None = None):
        self.inner, self.before_call = inner, before_call or {}
        self.calls: list[list[int]] = []
        self.request_ids: list[str | None] = []

    async def generate(self, input_ids, sampling, request_id=None):
        hook = self.before_call.get(len(self.calls))
        if hook is not None:
            await hook(self.inner)
        self.calls.append(list(input_ids))
        self.request_ids.append(request_id)
        return await self.inner.generate(input_ids, sampling, request_id)

    async def abort(self, request_id):
        await self.inner.abort(request_id)

    async def pause(self, mode="keep"):
        await self.inner.pause(mode)

    async def resume(self):
        await self.inner.resume()

    async def update_weights(self, version, source):
        await self.inner.update_weights(version, source)

    async def flush_cache(self):
        await self.inner.flush_cache()

    async def health(self):
        return await self.inner.health()

    @property
    def policy_version(self):
        return self.inner.policy_version

    async def close(self):
        await self.inner.close()


def embedded_engine(model_dir: Path, **kw: Any) -> Engine:
    from agentrl.engines.embedded import EmbeddedEngine

    return EmbeddedEngine(
        str(model_dir),
        max_seq_len=kw.pop("max_seq_len", 256),
        max_batch_size=kw.pop("max_batch_size", 16),
        **kw,
    )
