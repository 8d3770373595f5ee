"""OpenAPI 3.1 description of `agentrl serve-engine` (engines/server.py), served at `/openapi.json`.

Request bodies are generated from the wire Structs (engines/wire.py, whose `msgspec.Meta` bounds decoding
enforces) and completed with what depends on the served engine (vocabulary size, max_seq_len) and the rules
JSON Schema can state that the engine checks itself: `input_ids` required, `stream` false, `top_k` -1 or
>= 1, an abort names a request or all. Every error is `{"error": {"message", "code", "field"?}}`.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

import msgspec

from agentrl import __version__
from agentrl.engines import wire

_BODIES = {
    "/generate": (wire.GenerateRequest, "Generate from token ids (SGLang's /generate, non-streaming)"),
    "/update_weights_from_disk": (wire.DiskUpdateRequest, "Load weights from a Hugging Face directory"),
    "/update_weights_from_tensor": (wire.TensorUpdateRequest, "Load weights from safetensors bytes (base64)"),
    "/init_weights_update_group": (
        wire.InitGroupRequest,
        "Join the trainer's weight-broadcast group (blocks)",
    ),
    "/update_weights_from_distributed": (wire.DistributedUpdateRequest, "Receive weights by broadcast"),
    "/pause_generation": (wire.PauseRequest, "Pause: abort, or keep running requests where they are"),
    "/abort_request": (wire.AbortRequest, "Abort one request by rid, or all"),
}
_ERRORS = {
    "400": "invalid request; `field` names what was wrong",
    "401": "missing or wrong bearer token; `field` is `Authorization`",
    "408": "body not received within the read timeout",
    "413": "body over the size limit",
}
_OPEN = ("/health", "/health_generate", "/openapi.json")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(codes: tuple[str, ...]) -> dict[str, Any]:
    out = {code: {"description": _ERRORS[code], "content": _json(_ref("Error"))} for code in codes}
    if "401" in out:
        out["401"]["headers"] = {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}}
    return out


def _specialise(components: dict[str, Any], vocab_size: int, max_seq_len: int, stop_strings: bool,
                images: bool) -> None:  # fmt: skip
    gen = components["GenerateRequest"]
    if images:
        gen["properties"]["image_data"]["description"] = (
            "one picture per run of image placeholder tokens in input_ids, in order: a data URL "
            "(data:image/png;base64,...) or base64 of a PNG, JPEG, GIF or WebP file; URLs are not fetched (400)"
        )
    else:
        gen["properties"]["image_data"] = {"type": "null", "default": None,
                                           "description": "the served model takes no images"}  # fmt: skip
    ids = gen["properties"]["input_ids"] = copy.deepcopy(gen["properties"]["input_ids"]["anyOf"][0])
    ids["items"]["maximum"] = vocab_size - 1
    ids["maxItems"] = max_seq_len - 1
    ids["description"] = f"token ids in [0, {vocab_size}), fewer than max_seq_len = {max_seq_len}"
    gen["required"] = ["input_ids"]
    gen["properties"]["stream"] = {"const": False, "default": False, "description": "streaming is not served"}
    gen["properties"]["top_logprobs_num"]["maximum"] = vocab_size
    sp = components["WireSamplingParams"]["properties"]
    sp["top_k"] = {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": 2**31 - 1}],
                   "default": -1, "description": "-1: off"}  # fmt: skip
    if stop_strings:
        sp["stop"]["description"] = "the output ends at the token that completes the first; text before it"
    else:
        sp["stop"] = {"type": "null", "default": None, "description": "needs the model's tokenizer.json"}
    abort = components["AbortRequest"]
    abort["anyOf"] = [
        {"required": ["rid"], "properties": {"rid": {"minLength": 1}}},
        {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}},
    ]


@lru_cache(maxsize=8)
def openapi_spec(
    *, vocab_size: int, max_seq_len: int, stop_strings: bool = True, images: bool = False
) -> dict[str, Any]:
    structs = [cls for cls, _ in _BODIES.values()]
    _, components = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    _specialise(components, vocab_size, max_seq_len, stop_strings, images)
    components["Error"] = {
        "type": "object",
        "properties": {"error": {"type": "object", "required": ["message", "code"], "properties": {
            "message": {"type": "string"}, "code": {"type": "integer"}, "field": {"type": "string"}}}},
        "required": ["error"],
    }  # fmt: skip
    any_object = {"type": "object"}
    paths: dict[str, Any] = {}
    for path, (cls, summary) in _BODIES.items():
        codes = ("400", "401", "408", "413")
        responses = {"200": {"description": "done", "content": _json(any_object)}, **_errors(codes)}
        if path != "/generate" and path != "/abort_request":
            responses["500"] = {"description": "the engine failed to apply it", "content": _json(any_object)}
        if path == "/generate":
            responses["503"] = {"description": "the engine failed", "content": _json(_ref("Error"))}
        body = {"required": path in ("/generate", "/abort_request"), "content": _json(_ref(cls.__name__))}
        paths[path] = {"post": {"summary": summary, "requestBody": body, "responses": responses}}
    done = {"200": {"description": "done", "content": _json(any_object)}, **_errors(("401",))}
    paths["/continue_generation"] = {"post": {"summary": "Resume after a pause (any body is ignored)",
                                              "responses": {**done, **_errors(("408", "413"))}}}  # fmt: skip
    paths["/flush_cache"] = {m: {"summary": "Free cached memory (no prefix cache)", "responses": done}
                             for m in ("get", "post")}  # fmt: skip
    for path in ("/get_model_info", "/get_server_info"):
        paths[path] = {"get": {"summary": "Model / server facts", "responses": done}}
    health = {"200": {"description": "healthy", "content": _json(any_object)},
              "503": {"description": "the scheduler died", "content": _json(any_object)}}  # fmt: skip
    for path in ("/health", "/health_generate"):
        paths[path] = {"get": {"summary": "Liveness (no token needed)", "security": [], "responses": health}}
    paths["/openapi.json"] = {"get": {"summary": "This document (no token needed)", "security": [],
                                      "responses": {"200": {"description": "OpenAPI 3.1",
                                                            "content": _json(any_object)}}}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "agentrl serve-engine (SGLang dialect)", "version": __version__},
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }


OPEN_PATHS = frozenset(_OPEN)
