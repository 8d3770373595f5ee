"""Which chat-completion parameters the proxy honours and how: the one owner of that rule (docs/agents.md
has the table). A request's parameters become the engine's `SamplingParams` for its turn, or a
`RequestError(400)` naming the parameter; nothing a client sends is silently ignored (unknown top-level
fields are refused by the request type, agentrl/proxy/openai_schema.py).

Per-request `temperature` / `top_p`: the engine reports logprobs under the sampling it used, and the learner
recomputes them under the run's sampling, so a request that differs from the run's sampling would make the
off-policy ratios wrong. The sampling policy (`rollout.proxy_sampling`, `serve-proxy --proxy-sampling`) says
what happens to such a request: `"refuse"` (the default) answers it with 400 naming the parameter;
`"record"` samples with it and records it per turn in the trajectory's metadata (`turn_sampling`), where the
learner does not read it today; `"override"` samples with the run's settings (the trained logprobs stay
right) and records what was asked per turn (`requested_sampling`), for frameworks that always send their own
default.

`max_tokens` / `max_completion_tokens` above the context left are capped to it (the session records the cap,
session.py); `stop` strings of any length end the reply where the text first holds one (SGLang stops
there, the embedded engine runs on and the proxy cuts the reply: agentrl/engines/stops.py);
`response_format` `json_object` / `json_schema` becomes the engine's `json_schema` (SGLang's structured
output; the embedded engine refuses it, and the proxy answers 400 naming `response_format`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from agentrl.engines.base import SamplingParams

SamplingPolicy = Literal["refuse", "record", "override"]
SAMPLING_POLICIES: tuple[str, ...] = ("refuse", "record", "override")
MAX_N = 64
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class RequestError(Exception):
    """A request the proxy cannot serve: HTTP `status`, and `param` naming the field at fault."""

    def __init__(self, status: int, message: str, param: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _refuse_unsupported(req: Any) -> None:
    """Parameters whose only supported value is the neutral one."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0):
            raise RequestError(400, f"{name} is not supported (the engine samples without penalties)", name)
    if req.logit_bias:
        raise RequestError(
            400, "logit_bias is not supported (the engine samples without biases)", "logit_bias"
        )
    if req.response_format is not None and req.response_format.type not in RESPONSE_FORMATS:
        raise RequestError(
            400,
            f"response_format type {req.response_format.type!r} is not one of {list(RESPONSE_FORMATS)}",
            "response_format.type",
        )
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise RequestError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")


def _json_schema(req: Any) -> str | None:
    """The engine's `json_schema` for the request's `response_format` (None: free text)."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}'
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise RequestError(400, "response_format json_schema needs json_schema.schema (a JSON Schema object)",
                           "response_format.json_schema.schema")  # fmt: skip
    return json.dumps(schema)


def requested_sampling(req: Any, run: SamplingParams) -> dict[str, float]:
    """The request's temperature / top_p where they differ from the run's (what `override` records)."""
    asked = {"temperature": req.temperature, "top_p": req.top_p}
    return {k: v for k, v in asked.items() if v is not None and v != getattr(run, k)}


def _sampling_overrides(req: Any, run: SamplingParams, policy: str) -> dict[str, float]:
    overrides: dict[str, float] = {}
    if req.temperature is not None:
        if req.temperature < 0:
            raise RequestError(400, "temperature must be >= 0", "temperature")
        overrides["temperature"] = req.temperature
    if req.top_p is not None:
        if not 0 < req.top_p <= 1:
            raise RequestError(400, "top_p must be in (0, 1]", "top_p")
        overrides["top_p"] = req.top_p
    differs = {k: v for k, v in overrides.items() if v != getattr(run, k)}
    if differs and policy == "refuse":
        name, value = next(iter(differs.items()))
        raise RequestError(
            400,
            f"{name}={value:g} differs from the run's sampling ({name}={getattr(run, name):g}); per-request "
            "sampling is refused (rollout.proxy_sampling / --proxy-sampling = 'refuse') so that the trained "
            "logprobs match the sampled ones: leave it out, send the run's value, or run the proxy with "
            "'override' (sample with the run's settings, record what was asked)",
            name,
        )
    return {} if policy == "override" else differs


def turn_sampling(req: Any, run: SamplingParams, chat: Any, max_seq_len: int, policy: str) -> SamplingParams:
    """The engine's sampling for one request (`req`: a ChatRequest), or RequestError naming the parameter.
    `max_new_tokens` is what was asked; the turn caps it to the context left and records the cap."""
    if not 1 <= req.n <= MAX_N:
        raise RequestError(400, f"n must be in [1, {MAX_N}]", "n")
    _refuse_unsupported(req)
    differs = _sampling_overrides(req, run, policy)
    max_tokens = next(
        (v for v in (req.max_completion_tokens, req.max_tokens) if v is not None), run.max_new_tokens
    )
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens < 1:
        raise RequestError(400, f"{name} must be >= 1", name)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not text for text in stops):
        raise RequestError(400, "stop strings must not be empty", "stop")
    # a stop that is one token also ends the engine's reply at that token (the embedded engine stops early)
    stop_ids = set(run.stop_token_ids) | set(chat.stop_ids)
    stop_ids.update(ids[0] for ids in map(chat.encode, stops) if len(ids) == 1)
    return msgspec.structs.replace(
        run,
        **differs,
        max_new_tokens=max_tokens,
        seed=req.seed if req.seed is not None else run.seed,
        stop_token_ids=sorted(stop_ids),
        stop=stops,
        json_schema=_json_schema(req),
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
    )
