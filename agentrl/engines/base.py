"""The engine interface every inference engine implements (embedded, SGLang over HTTP, a Ray actor handle).

Invariants: every generated token carries the policy version of the weights that produced it (`versions`
holds runs of `(policy_version, n_tokens)` summing to `len(output_ids)`); `logprobs[i]` is
`log_softmax(logits / temperature)[output_ids[i]]`: the distribution sampled from when top_p = 1 and
top_k = -1, and the same quantity the learner computes, so importance ratios compare like with like
(top-p/top-k truncation is left out of the logprob on purpose, as in slime and SGLang). Greedy
(temperature 0) reports the temperature-1 logprob. `top_logprobs = k > 0` asks for each generated token's k
most likely tokens under that same distribution (`GenerateOutput.top_logprobs[i]`: `(token_id, logprob)`
pairs, most likely first). `images` (a vision-language model): the pictures of the input, one per run of image
placeholder tokens in `input_ids`, in order (agentrl.types.Image: the file bytes and their SHA-256); engines of
text-only models take none, and callers without images leave the argument out (`image_kwargs`).
This module imports no torch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from agentrl.errors import AgentRLError, EngineError
from agentrl.types.trajectory import Image, RoutedExperts

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "wait", "keep"]


# peft's names of a LoRA pair's tensors (an adapter publish holds only such names)
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = []
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0  # k most likely tokens reported per generated token (0: none)
    return_routed_experts: bool = False  # MoE: report the router's experts per position (GenerateOutput)
    # stop strings: an engine that detokenizes (SGLang) ends the output at the token that completes one; the
    # embedded engine samples ids only and runs on to a stop token or max_new_tokens, so a caller that needs
    # them finds them in the text (the proxy does, agentrl/chat.py `find_stop`)
    stop: list[str] = []
    # structured output: the reply must match this JSON schema (SGLang's `json_schema`, a grammar-constrained
    # decode); the embedded engine has no grammar backend and refuses it (InvalidRequest)
    json_schema: str | None = None


class GenerateOutput(msgspec.Struct, kw_only=True):
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    versions: list[tuple[int, int]]
    prompt_tokens: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per output token when asked (SamplingParams)
    # MoE engines asked for them: the router's experts for every position the request ran a forward on
    # (prompt and output, the last output token excluded); see agentrl.types.RoutedExperts
    routed_experts: RoutedExperts | None = None


def image_kwargs(images: list[Image] | None) -> dict[str, Any]:
    """`generate`'s keyword for `images` when there are any (engines of text-only models need not take it)."""
    return {"images": images} if images else {}


class InvalidRequest(EngineError):
    """A generate request is malformed (empty input, ids outside the vocabulary, bad sampling value)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray (pickle) with both arguments
        return type(self), (self.field, self.message)


class RequestFailed(EngineError):
    """One engine request failed; the message is one line naming the engine, the request id and the cause."""

    def __init__(self, engine: str, request_id: str | None, cause: str):
        super().__init__(f"{engine}: request {request_id or '(no id)'}: {cause}")
        self.engine, self.request_id, self.cause_text = engine, request_id, cause

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.engine, self.request_id, self.cause_text)


def describe_error(exc: BaseException) -> str:
    """A failure on one line: the innermost exception under Ray's wrappers (`RayTaskError.cause`), the first
    line of its message, led by its class unless it is one of agentrl's own errors (their messages say it)."""
    for _ in range(8):  # bounded: a `cause` chain could loop
        inner = getattr(exc, "cause", None)
        if not isinstance(inner, BaseException) or inner is exc:
            break
        exc = inner
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    if isinstance(exc, AgentRLError) and first:
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@dataclass
class TensorSource:
    """Weights as in-memory `(hf_name, tensor)` pairs (same process, or shipped through Ray's object store)."""

    tensors: Any  # iterable of (str, torch.Tensor) or dict[str, torch.Tensor]


@dataclass
class DiskSource:
    """A Hugging Face model directory on disk (safetensors)."""

    path: str


@dataclass
class DistributedSource:
    """Tensors arrive by `torch.distributed.broadcast` from rank 0 of an already-initialised group."""

    group_name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class AdapterSource:
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) for the served base model:
    SGLang loads it by name (`/load_lora_adapter`), the embedded engine merges it."""

    path: str


WeightSource = TensorSource | DiskSource | DistributedSource | AdapterSource


class Engine(abc.ABC):
    """An async inference engine. Implementations must be safe to call from many coroutines at once."""

    @abc.abstractmethod
    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        images: list[Image] | None = None,
    ) -> GenerateOutput: ...

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = "keep") -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def update_weights(self, version: int, source: WeightSource) -> None: ...

    async def update_during_generation(self, version: int, source: WeightSource, mode: PauseMode) -> None:
        """Load `version` from one source while requests run, treating the running ones as `mode` says (keep:
        they go on with the new weights; abort: they end with finish_reason 'abort'; wait: they finish first),
        new ones waiting for the new weights. Here: pause, update, resume; a server that does it in one request
        for every client's requests (agentrl.engines.sglang) overrides this."""
        if mode == "keep":  # weights swap between two decode steps
            await self.update_weights(version, source)
            return
        await self.pause(mode)
        try:
            await self.update_weights(version, source)
        finally:
            await self.resume()

    @abc.abstractmethod
    async def flush_cache(self) -> None: ...

    async def release_memory(self) -> None:
        """Give the GPU memory this engine can spare back while a colocated learner trains (`run.offload`)."""
        raise EngineError(f"{type(self).__name__} cannot release its memory (run.offload)")

    async def resume_memory(self, tags: list[str]) -> None:
        """Take back what `release_memory` gave: tags 'weights' (then a weight update follows), 'kv_cache'."""
        raise EngineError(f"{type(self).__name__} cannot resume its memory (run.offload)")

    @abc.abstractmethod
    async def health(self) -> dict[str, Any]: ...

    @property
    @abc.abstractmethod
    def policy_version(self) -> int: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (threads, subprocesses, sessions)."""
