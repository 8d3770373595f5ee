"""OpenAPI 3.1 description of the queue's HTTP API, with the trajectory schema generated from the Struct."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from agentrl import __version__
from agentrl.types import Trajectory

_ERROR_CODES = {
    "400": "malformed body (not msgpack / JSON)",
    "401": "missing or wrong bearer token",
    "413": "body over queue.max_body_bytes",
    "415": "content type other than application/msgpack or application/json",
    "422": "invalid trajectory; `field` names the offending field",
    "429": "backpressure (staleness window, count or byte cap); honour Retry-After",
    "503": "draining; honour Retry-After",
    "507": "the write-ahead log could not store the request; nothing was accepted",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


@cache
def openapi_spec() -> dict[str, Any]:
    _, components = msgspec.json.schema_components([Trajectory], ref_template="#/components/schemas/{name}")
    components["Error"] = {
        "type": "object",
        "properties": {"error": {"type": "string"}, "field": {"type": ["string", "null"]}},
        "required": ["error", "field"],
    }
    components["Submitted"] = {
        "type": "object",
        "properties": {n: {"type": "integer"} for n in ("accepted", "duplicates", "dropped")},
        "required": ["accepted", "duplicates"],
    }
    one_or_many = {"oneOf": [_ref("Trajectory"), {"type": "array", "items": _ref("Trajectory")}]}
    errors = {
        code: {"description": text, "content": _json(_ref("Error"))} for code, text in _ERROR_CODES.items()
    }
    token_arrays = (
        "Token arrays (prompt_ids, response_ids, loss_mask) are lists of ints or little-endian int32 bytes "
        "(msgpack bin / base64 in JSON; loss_mask uint8); logprobs float32. Send either token ids or "
        "chat-form `messages` (tokenized by the server with the run's tokenizer)."
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": "agentrl replay queue", "version": __version__, "description": token_arrays},
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/trajectories": {
                "post": {
                    "summary": "Submit one trajectory or a list (all or nothing; duplicates by id are counted)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/msgpack": {"schema": one_or_many},
                            "application/json": {"schema": one_or_many},
                        },
                    },
                    "responses": {"202": {"description": "accepted", "content": _json(_ref("Submitted"))}, **errors},
                }
            },
            "/v1/status": {"get": {"summary": "Queue depth, policy version, counts, staleness histogram",
                                   "responses": {"200": {"description": "status", "content": _json({"type": "object"})}}}},
            "/metrics": {"get": {"summary": "Prometheus text format",
                                 "responses": {"200": {"description": "metrics",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/healthz": {"get": {"summary": "Liveness (no token needed); 503 while draining", "security": [],
                                 "responses": {"200": {"description": "ok"}, "503": {"description": "draining"}}}},
            "/openapi.json": {"get": {"summary": "This document (no token needed)", "security": [],
                                      "responses": {"200": {"description": "OpenAPI 3.1"}}}},
        },
    }  # fmt: skip
