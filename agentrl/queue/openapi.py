"""OpenAPI 3.1 description of the queue's HTTP API: the trajectory schema is generated from the Struct (whose
`msgspec.Meta` bounds decoding also enforces) and completed here with what depends on the serving queue (the
vocabulary, the current policy version, whether chat form is on) and the rules JSON Schema can state: the two
forms, `policy_version` xor `versions`, one status code per answer the server gives.

Three rules cross fields and have no JSON Schema keyword: `loss_mask` / `logprobs` hold one value per response
token (`x-same-length-as`), `versions` counts add up to the response length (`x-counts-sum-to-length-of`), and
`routed_experts.data` holds whole `layers x topk` rows for the positions of prompt + response
(`x-rows-cover`: total - 1 or total of them; agentrl.types.validate says exactly). Images add two:
an image's `sha256` is that of its `data` (`x-sha256-of`), and `image_spans` place stored images at token
positions of prompt + response (`x-positions-in`; each image placed, spans in order, one placeholder id
repeated, untrained in the response).
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

import msgspec

from agentrl import __version__
from agentrl.types import (
    LOGPROB_MAX,
    LOGPROB_MIN,
    METADATA_MAX,
    METADATA_MIN,
    PACKED_DTYPES,
    ROLES,
    Trajectory,
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_ARRAYS = ("prompt_ids", "response_ids", "loss_mask", "logprobs")
_SUBMIT_ERRORS = {
    "400": "malformed body (not msgpack / JSON); `field` is `body`",
    "408": "body not received within queue.read_timeout_s",
    "413": "body over queue.max_body_bytes (`field` is `body`), or an image file over queue.max_image_bytes "
    "(`field` names it: `images[0].data`)",
    "415": "content type other than application/msgpack or application/json; `field` is `Content-Type`",
    "422": "invalid trajectory: `field` is its path (`id`, `[1].id`, `messages[2].role`, `response_ids[3]`)",
    "429": "backpressure (staleness window, count or byte cap); honour Retry-After",
    "503": "draining; honour Retry-After",
    "507": "the write-ahead log could not store the request; nothing was accepted",
}
_INT = {"type": "integer", "minimum": 0}
# standard base64 with padding, as msgspec decodes it (JSON carries routed_experts.data so)
_BASE64 = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
_ROUTED = (
    "optional (rollout routing replay; left out, the learner routes this trajectory itself): the experts the "
    "MoE engine's router chose for token positions 0..n-1 of prompt_ids + response_ids, `data` row-major "
    "[n, layers, topk] (`layers`: the MoE layers, in model order), n = total tokens - 1 (every token but "
    "the last sampled one) or total; it may stop earlier only where the tokens after it are all untrained "
    "(loss_mask 0). int16 ids are >= 0."
)
_IMAGES = (
    "optional: the image files the trajectory shows (PNG, JPEG, GIF or WebP), each stored once and named by "
    "the SHA-256 of its bytes; every one is placed by `image_spans`. Each file is at most queue.max_image_bytes "
    "(413 above)."
)
_SPANS = (
    "where the images sit in the token stream, in token order, not overlapping: `length` tokens of the model's "
    "image placeholder (one id repeated) from position `start` of prompt_ids + response_ids, made from the "
    "vision patch grid `grid_thw` [t, h, w] (t*h*w a multiple of length); in the response they are untrained "
    "(loss_mask 0). Given with `images`."
)
_WAIT = {"type": "object", "properties": {k: {"type": "number", "minimum": 0} for k in ("count", "sum_s", "mean_s", "max_s")}}  # fmt: skip
_STATUS = {
    "type": "object",
    "properties": {
        **{k: _INT for k in ("depth", "ready", "pending_groups", "in_sample", "bytes", "in_flight", "admitted",
                             "policy_version", "max_staleness", "group_size", "known_ids", "committed_total")},
        **{k: {"type": ["integer", "null"]} for k in ("window", "last_committed_step", "wal_bytes")},
        "batch_size": {"type": "integer"},
        "draining": {"type": "boolean"},
        "counts": {"type": "object", "additionalProperties": _INT},
        "staleness": {"type": "object", "additionalProperties": _INT},
        "sample_wait": _WAIT,
        "reserve_wait": _WAIT,
        "vocab_size": {"type": ["integer", "null"], "minimum": 1},
        "token_ids_checked": {"type": "boolean", "description": "false: serve-queue runs without --model or "
                              "--vocab-size, and token ids are only checked to be int32 and >= 0"},
    },
    "required": ["depth", "policy_version", "counts", "draining", "vocab_size", "token_ids_checked"],
}  # fmt: skip
_JSON_VALUE = {
    "description": "metadata: plain JSON, numbers within msgpack's integer range (the log stores it as msgpack)",
    "anyOf": [
        {"type": ["null", "boolean", "string"]},
        {"type": "number", "minimum": METADATA_MIN, "maximum": METADATA_MAX},
        {"type": "array", "items": _ref("JSONValue")},
        {"type": "object", "additionalProperties": _ref("JSONValue")},
    ],
}
_DESCRIPTION = (
    "Submit trajectories as token ids (prompt_ids, response_ids, optional loss_mask / logprobs / versions) or, "
    "when the server has the run's tokenizer (`--model`), in chat form (`messages`, tokenized by the server "
    "as the multi-turn generator would). JSON bodies send arrays as lists of numbers. msgpack bodies may also "
    'send an array as `{"dtype": ..., "data": <bin>}` (little-endian; int32/int64/uint8 for token ids and '
    "loss_mask, float32/float64 for logprobs); bare bytes are refused (their dtype would be a guess). "
    "`routed_experts` (MoE rollout routing replay, optional) is `{layers, topk, dtype, data}` with `data` "
    "base64 in JSON and bin in msgpack. Images (vision-language models) travel once per trajectory in `images` "
    "(`data`: base64 in JSON, bin in msgpack), placed in the tokens by `image_spans`; chat form takes text only. "
    "Integers written as integral floats (608.0) are integers. Every "
    "error is `{error, field}`, `field` naming what was wrong; a request is all or nothing."
)


# chat form is tokenized by the queue, which has no image processor: a message's parts are text there
_TEXT_ONLY = {
    "properties": {
        "content": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": _ref("TextPart")}],
            "description": "text, or text parts (image parts need the token form: images + image_spans)",
        }
    }
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _trajectory(base: dict[str, Any], *, packed: bool, vocab_size: int | None, policy_version: int,
                chat: bool) -> dict[str, Any]:  # fmt: skip
    """The Struct's schema for one media type and the serving queue's state."""
    schema = copy.deepcopy(base)
    props = schema["properties"]
    # bare bytes (base64 strings in JSON) are refused on the wire; {"dtype", "data"} only in msgpack
    for name in _ARRAYS:
        keep = []
        for variant in props[name]["anyOf"]:
            if "$ref" in variant and packed:
                dtypes = {"properties": {"dtype": {"enum": list(PACKED_DTYPES[name])}}}
                keep.append({"allOf": [variant, dtypes]})
            elif variant.get("type") == "array" and name.endswith("_ids") and vocab_size is not None:
                variant["items"]["maximum"] = vocab_size - 1
                keep.append(variant)
            elif variant.get("type") in ("array", "null"):
                keep.append(variant)
        props[name] = {"anyOf": keep} if len(keep) > 1 else keep[0]
    for name in ("loss_mask", "logprobs"):
        props[name]["description"] = "one value per response_ids token"
        props[name]["x-same-length-as"] = "response_ids"
    logprob = f"log-probabilities: <= 0, up to {LOGPROB_MAX:g} of float rounding, >= {LOGPROB_MIN:g}"
    props["logprobs"]["description"] += f" ({logprob})"
    # JSON is described with per-token `response` rows [token_id, loss_mask, logprob] (agentrl/queue/rows.py),
    # where neither per-token rule can be broken, or `response_ids` alone (every token trained, no logprobs);
    # the separate lists, which JSON bodies may still send, are described by the msgpack form
    if not packed:
        ids = props["response_ids"]["anyOf"][0] if "anyOf" in props["response_ids"] else props["response_ids"]
        row = {"type": "array", "minItems": 3, "maxItems": 3, "prefixItems": [
            ids["items"], {"type": "integer", "minimum": 0, "maximum": 1},
            {"type": "number", "minimum": LOGPROB_MIN, "maximum": LOGPROB_MAX}]}  # fmt: skip
        props["response"] = {"type": "array", "minItems": 1, "items": row, "description": "one row per "
                             f"response token: [token_id, loss_mask (0 / 1), logprob ({logprob})]"}  # fmt: skip
        for name in ("loss_mask", "logprobs", "versions"):
            del props[name]
    if packed:
        versions = props["versions"]["anyOf"][0]
        versions["items"]["prefixItems"][0]["maximum"] = policy_version
        props["versions"].update(description="runs [policy_version, n_tokens] covering every response token",
                                 **{"x-counts-sum-to-length-of": "response_ids"})  # fmt: skip
    props["metadata"]["additionalProperties"] = _ref("JSONValue")
    if packed:
        props["routed_experts"]["anyOf"][0] = _ref("RoutedExpertsMsgpack")
    covered = ["prompt_ids", "response_ids"] if packed else ["prompt_ids", "response_ids", "response"]
    props["routed_experts"].update(description=_ROUTED, **{"x-rows-cover": covered})
    if packed:
        props["images"]["anyOf"][0]["items"] = _ref("ImageMsgpack")
    props["images"].update(description=_IMAGES)
    props["image_spans"].update(description=_SPANS, **{"x-positions-in": covered})
    props["policy_version"]["anyOf"][0]["maximum"] = policy_version
    props["policy_version"]["description"] = "at most the queue's current version; left out: stamped with it"
    for name in ("prompt_ids", "response_ids"):
        props[name].pop("default", None)
    if packed:
        both = {"required": ["policy_version", "versions"],
                "properties": {"policy_version": {"type": "integer"}, "versions": {"type": "array"}}}  # fmt: skip
        schema["not"] = both  # give either policy_version or versions
    responses = ("response_ids",) if packed else ("response_ids", "response")
    # the token form: the response as ids (JSON: or as rows, not both)
    token = [{"required": [name], "not": {"anyOf": [{"required": [other]} for other in responses if other != name]}}
             if len(responses) > 1 else {"required": [name]} for name in responses]  # fmt: skip
    if not chat:
        props["messages"] = {
            "type": "null",
            "description": "chat form needs the server's tokenizer (--model)",
        }
        schema["required"] = ["id"]
        schema["oneOf"] = token
        return schema
    first = {"properties": {"role": {"enum": [r for r in ROLES if r != "assistant"]},
                            "content": _TEXT_ONLY["properties"]["content"]}}  # fmt: skip
    reply = {"properties": {"role": {"const": "assistant"}}}
    chat_form = {
        "required": ["messages"],
        "properties": {
            "messages": {
                "type": "array",
                "minItems": 2,
                "prefixItems": [first],
                "contains": reply,
                "items": _TEXT_ONLY,
            },
            **{
                name: {"type": "null"}
                for name in ("loss_mask", "logprobs", "versions", "routed_experts", "images", "image_spans")
                if name in props
            },
        },
        "not": {"anyOf": [{"required": [name]} for name in ("prompt_ids", *responses)]},
    }
    no_messages = {"properties": {"messages": {"type": "null"}}}
    schema["oneOf"] = [*({**form, **no_messages} for form in token), chat_form]
    return schema


@lru_cache(maxsize=8)
def openapi_spec(
    *, policy_version: int = 0, vocab_size: int | None = None, chat: bool = False
) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "agentrl replay queue", "version": __version__, "description": _DESCRIPTION},
        "components": {
            "schemas": _components(policy_version=policy_version, vocab_size=vocab_size, chat=chat),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": _paths(),
    }


def _components(*, policy_version: int, vocab_size: int | None, chat: bool) -> dict[str, Any]:
    """The schemas: the trajectory in both forms (with what depends on the serving queue) and the answers."""
    _, components = msgspec.json.schema_components([Trajectory], ref_template="#/components/schemas/{name}")
    base = components.pop("Trajectory")
    state = {"vocab_size": vocab_size, "policy_version": policy_version, "chat": chat}
    components["Trajectory"] = _trajectory(base, packed=False, **state)
    components["TrajectoryMsgpack"] = _trajectory(base, packed=True, **state)
    components["Packed"]["properties"]["data"] = {"description": "msgpack bin: little-endian values of dtype"}
    routed = components["RoutedExperts"]
    routed["description"] = "expert ids of an MoE router, per position and MoE layer (see routed_experts)"
    msgpack_routed = components["RoutedExpertsMsgpack"] = {
        **copy.deepcopy(routed),
        "title": "RoutedExpertsMsgpack",
    }
    routed["properties"]["data"] = {"type": "string", "contentEncoding": "base64", "pattern": _BASE64,
                                    "description": "base64 of the little-endian dtype ids"}  # fmt: skip
    msgpack_routed["properties"]["data"] = {"description": "msgpack bin: little-endian dtype ids"}
    img = components["Image"]
    img["properties"]["sha256"]["x-sha256-of"] = "data"
    components["ImageMsgpack"] = {**copy.deepcopy(img), "title": "ImageMsgpack"}
    img["properties"]["data"] = {"type": "string", "contentEncoding": "base64", "pattern": _BASE64,
                                 "description": "base64 of the image file"}  # fmt: skip
    components["ImageMsgpack"]["properties"]["data"] = {"description": "msgpack bin: the image file"}
    components["ImagePart"]["properties"]["data"].update(description="the image file (base64 in JSON)",
                                                         pattern=_BASE64)  # fmt: skip
    components["Error"] = {
        "type": "object",
        "properties": {"error": {"type": "string"}, "field": {"type": ["string", "null"]}},
        "required": ["error", "field"],
    }
    components["Submitted"] = {
        "type": "object",
        "properties": {n: _INT for n in ("accepted", "duplicates", "dropped")},
        "required": ["accepted", "duplicates", "dropped"],
    }
    components["Status"] = _STATUS
    components["JSONValue"] = _JSON_VALUE
    return components


def _paths() -> dict[str, Any]:
    """Each endpoint with one status code per answer the server gives."""

    def one_or_many(name: str) -> dict[str, Any]:
        return {"schema": {"oneOf": [_ref(name), {"type": "array", "items": _ref(name)}]}}

    def error(text: str, headers: tuple[str, ...] = ()) -> dict[str, Any]:
        out: dict[str, Any] = {"description": text, "content": _json(_ref("Error"))}
        if headers:
            out["headers"] = {h: {"required": True, "schema": {"type": "string"}} for h in headers}
        return out

    unauthorized = {
        "401": error("missing or wrong bearer token; `field` is `Authorization`", ("WWW-Authenticate",))
    }
    submit_errors = {code: error(text, ("Retry-After",) if code in ("429", "503") else ()) for code, text in _SUBMIT_ERRORS.items()}  # fmt: skip
    return {
        "/v1/trajectories": {
            "post": {
                "summary": "Submit one trajectory or a list (all or nothing; duplicates by id are counted)",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": one_or_many("Trajectory"),
                        "application/msgpack": one_or_many("TrajectoryMsgpack"),
                    },
                },
                "responses": {"202": {"description": "accepted", "content": _json(_ref("Submitted"))},
                              **unauthorized, **submit_errors},
            }
        },
        "/v1/status": {"get": {"summary": "Queue depth, policy version, counts, staleness histogram",
                               "responses": {"200": {"description": "status", "content": _json(_ref("Status"))},
                                             **unauthorized}}},
        "/metrics": {"get": {"summary": "Prometheus text format",
                             "responses": {"200": {"description": "metrics",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **unauthorized}}},
        "/healthz": {"get": {"summary": "Liveness (no token needed); 503 while draining", "security": [],
                             "responses": {code: {"description": text, "content": _json(
                                 {"type": "object", "properties": {"status": {"enum": ["ok", "draining"]}},
                                  "required": ["status"]})} for code, text in (("200", "ok"), ("503", "draining"))}}},
        "/openapi.json": {"get": {"summary": "This document (no token needed)", "security": [],
                                  "responses": {"200": {"description": "OpenAPI 3.1",
                                                        "content": _json({"type": "object"})}}}},
    }  # fmt: skip
