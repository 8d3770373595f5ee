"""`agentrl diagnose mismatch`: where an engine's log-probs and the torch learner's part ways.

The engine samples continuations of seeded random prompts (its reported log-probs); the learner's forward (the
Hugging Face model the torch learner trains) scores the same token sequences. With the embedded engine both
sides then run each sequence once more recording every layer's outputs at Hugging Face's module boundaries
(the engine's `CausalLM.trace`, forward hooks on the learner's modules; an MoE layer's router logits too), and
the first (layer, op) whose output
differs by more than `rel_tol` (max |Δ| over max |learner|) is where the two diverge. An SGLang engine (a URL)
is compared on log-probs only: its `return_hidden_states` gives the last layer's hidden state alone, which
cannot say which layer diverged.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from agentrl.engines.model import TRACE_OPS as OPS  # the ops both sides record, in forward order


@dataclass
class Report:
    tokens: int
    equal: int  # tokens whose log-probs are bit-for-bit equal
    mean_abs: float
    max_abs: float
    layers: list[tuple[int, str, float, float]] = field(
        default_factory=list
    )  # (layer, op, max |Δ|, relative)
    first: tuple[int, str] | None = None  # the first diverging (layer, op)

    def markdown(self) -> str:
        lines = [
            "| sampled tokens | bit-equal | mean abs diff logprob | max abs diff logprob |",
            "|---|---|---|---|",
            f"| {self.tokens} | {self.equal} | {self.mean_abs:.3g} | {self.max_abs:.3g} |",
        ]
        if self.layers:
            lines += ["", "| layer | op | max abs diff | relative | |", "|---|---|---|---|---|"]
            for layer, op, diff, rel in self.layers:
                mark = "first divergence" if (layer, op) == self.first else ""
                lines.append(f"| {layer} | {op} | {diff:.3g} | {rel:.3g} | {mark} |")
            where = f"layer {self.first[0]}, {self.first[1]}" if self.first else "no layer"
            lines += ["", f"First divergence: {where}."]
        return "\n".join(lines)


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def learner_trace(model, tokens: list[int]) -> tuple[torch.Tensor, dict[tuple[int, str], torch.Tensor]]:
    """(logits [S, V], {(layer, op): [S, hidden]}) of the Hugging Face model on one sequence."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        for op in OPS:
            # an MoE block's router is `mlp.gate` (returning logits [tokens, experts], weights, ids); a dense MLP
            # has none
            module = layer if op == "output" else layer.mlp if op == "router" else getattr(layer, op)
            if op == "router":
                module = getattr(module, "gate", None)
                if module is None:
                    continue

            def hook(_m, _inp, res, key=(i, op)):
                value = res[0] if isinstance(res, tuple) else res
                out[key] = (value if key[1] == "router" else value[0]).detach()

            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    finally:
        for h in handles:
            h.remove()
    return logits, out


def compare(model_dir: str, engine, *, prompts: int = 4, prompt_len: int = 16, new_tokens: int = 16,
            temperature: float = 1.0, rel_tol: float = 1e-4, seed: int = 0) -> Report:  # fmt: skip
    """Run the comparison against `engine` (an agentrl Engine; the embedded one also gets the layer table)."""
    from transformers import AutoModelForCausalLM

    from agentrl.engines.base import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    sampling = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True)
    ps = _prompts(vocab, prompts, prompt_len, seed)

    async def sample():
        try:
            return await asyncio.gather(*(engine.generate(p, sampling) for p in ps))
        finally:
            await engine.close()

    outs = asyncio.run(sample())
    diffs, equal, layer_diff = [], 0, {}
    trace = getattr(getattr(engine, "model", None), "trace", None)
    for p, o in zip(ps, outs, strict=True):
        seq = p + list(o.output_ids)
        logits, hidden = learner_trace(model, seq)
        logp = torch.log_softmax(logits[len(p) - 1 : -1].float() / temperature, dim=-1)
        learner = logp.gather(1, torch.tensor(o.output_ids)[:, None])[:, 0]
        engine_lp = torch.tensor(o.logprobs, dtype=torch.float32)
        equal += int((learner == engine_lp).sum())
        diffs.append((learner - engine_lp).abs())
        if trace is not None:
            for key, value in trace(torch.tensor(seq, device=engine.device)).items():
                ref = hidden[key].reshape(value.shape)
                diff = float((value.float().cpu() - ref.float()).abs().max())
                scale = float(ref.float().abs().max()) or 1.0
                old = layer_diff.get(key, (0.0, 0.0))
                layer_diff[key] = (max(old[0], diff), max(old[1], diff / scale))
    d = torch.cat(diffs)
    report = Report(tokens=d.numel(), equal=equal, mean_abs=float(d.mean()), max_abs=float(d.max()))
    for (layer, op), (diff, rel) in sorted(
        layer_diff.items(), key=lambda kv: (kv[0][0], OPS.index(kv[0][1]))
    ):
        report.layers.append((layer, op, diff, rel))
        if report.first is None and rel > rel_tol:
            report.first = (layer, op)
    return report
