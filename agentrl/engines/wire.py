"""The SGLang HTTP dialect as agentrl speaks it: request bodies, response shaping, tensor payloads.

Shared by `agentrl serve-engine` (server.py) and the SGLang client (sglang.py). Request bodies are msgspec
Structs with `forbid_unknown_fields`, so a misspelt key is a 400 that names it. Field names follow SGLang
0.5.x (`/generate`: input_ids, sampling_params, return_logprob, top_logprobs_num (answered in
`meta_info.output_top_logprobs`: per output token, `[logprob, token_id, null]` most likely first), rid;
`/update_weights_from_*`:
weight_version as a string, flush_cache, abort_all_requests). agentrl's additions: `meta_info.agentrl_versions`
(per-token version runs) and `load_format = "agentrl_safetensors"` for `/update_weights_from_tensor` (base64
or raw-msgpack safetensors bytes, works on CPU; SGLang's own format is a pickled CUDA-IPC payload).
MoE routing (SGLang's `--enable-return-routed-experts`): the request field `return_routed_experts` asks for the
router's choices, answered in `meta_info.routed_experts` as SGLang does: base64 of row-major
`[prompt + output tokens - 1, num_hidden_layers, num_experts_per_tok]` expert ids in
`meta_info.routed_experts_dtype` (int32 when absent; dense layers' rows are 0). The client keeps the MoE layers'
rows (`decode_routed_experts`), the `RoutedExperts` record agentrl stores.
Images (a vision-language model): `image_data`, SGLang's field, one entry per run of image placeholder tokens in
`input_ids`, in order; agentrl sends and takes data URLs (`data:image/png;base64,...`) or bare base64. It never
fetches: an http(s) URL or a file path is refused, naming the entry.
Imports no torch at module level.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from agentrl.engines.base import GenerateOutput, SamplingParams
from agentrl.engines.moe_spec import MoeSpec
from agentrl.types.trajectory import (
    EXPERT_DTYPES,
    Image,
    RoutedExperts,
    image,
    image_format,
    routed_expert_ids,
)

AGENTRL_TENSOR_FORMAT = "agentrl_safetensors"
VERSIONS_KEY = "agentrl_versions"
ROUTED_WIRE_DTYPES = {
    "int32": np.dtype("<i4"),
    "uint16": np.dtype("<u2"),
    "uint8": np.dtype("u1"),
}  # SGLang's
# bounds decoding enforces (and /openapi.json states, engines/openapi.py); the engine checks the rest
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
SERVE_ENGINE = "agentrl-embedded"  # /get_model_info's `engine` from `agentrl serve-engine`


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class WireSamplingParams(_Body, omit_defaults=True):
    """SGLang's sampling_params subset that agentrl implements (`sampling_seed` is SGLang's name for seed)."""

    temperature: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)] = -1  # -1 (off) or >= 1
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] = 128
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    seed: Seed | None = None
    sampling_seed: Seed | None = None
    # stop strings are taken as SGLang takes them; the embedded engine does not end early at them (see
    # SamplingParams.stop). SGLang's json_schema is not a field: the embedded engine has no grammar backend
    stop: str | list[str] | None = None

    def to_sampling(self) -> SamplingParams:
        seed = self.sampling_seed if self.sampling_seed is not None else self.seed
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=seed,
            ignore_eos=self.ignore_eos,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
        )


def generate_body(
    input_ids: list[int], sp: SamplingParams, rid: str | None = None, images: list[Image] | None = None
) -> dict[str, Any]:
    """The `/generate` request for one engine request (top logprobs travel as SGLang's `top_logprobs_num`)."""
    body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling_to_wire(sp),
                            "return_logprob": True}  # fmt: skip
    if images:
        body["image_data"] = images_to_wire(images)
    if sp.top_logprobs:
        body["top_logprobs_num"] = sp.top_logprobs
    if sp.return_routed_experts:
        body["return_routed_experts"] = True
    if rid is not None:
        body["rid"] = rid
    return body


def collapse_image_runs(input_ids: list[int], runs: list[tuple[int, int]]) -> list[int]:
    """`input_ids` with each image placeholder run (start, length; agentrl.vision.placeholder_runs) cut to its
    first token: agentrl's token streams hold each picture's expanded placeholders (agentrl.vision), SGLang's
    multimodal processor takes one per picture and expands it itself (an expanded run reaches transformers'
    processor as that many pictures)."""
    out: list[int] = []
    at = 0
    for start, length in runs:
        out += input_ids[at : start + 1]
        at = start + length
    return out + input_ids[at:]


def images_to_wire(images: list[Image]) -> list[str]:
    """Each picture as a data URL (SGLang's `image_data` takes them)."""
    return [
        f"data:image/{image_format(i.data) or 'png'};base64,{base64.b64encode(i.data).decode()}"
        for i in images
    ]


def images_from_wire(value: str | list[str] | None) -> list[Image]:
    """`image_data` -> pictures; ValueError naming the entry (`image_data[1]`) for one that is no inline image."""
    entries = [value] if isinstance(value, str) else list(value or [])
    out = []
    for i, entry in enumerate(entries):
        at = f"image_data[{i}]" if isinstance(value, list) else "image_data"
        if entry.startswith(("http://", "https://", "file:", "/")):
            raise ValueError(
                f"{at}: the engine does not fetch images; send the file inline (a data URL or base64)"
            )
        payload = entry.split(",", 1)[1] if entry.startswith("data:") and "," in entry else entry
        try:
            data = base64.b64decode(payload, validate=True)
        except ValueError:
            raise ValueError(f"{at}: not a data URL or base64") from None
        if image_format(data) is None:
            raise ValueError(f"{at}: not a PNG, JPEG, GIF or WebP file")
        out.append(image(data))
    return out


def sampling_to_wire(sp: SamplingParams) -> dict[str, Any]:
    """Engine SamplingParams -> SGLang sampling_params (seed travels as `sampling_seed`)."""
    out: dict[str, Any] = {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "max_new_tokens": sp.max_new_tokens,
        "ignore_eos": sp.ignore_eos,
    }
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.seed is not None:
        out["sampling_seed"] = sp.seed
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.json_schema is not None:
        out["json_schema"] = sp.json_schema
    return out


class GenerateRequest(_Body):
    input_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)] | None = None
    sampling_params: WireSamplingParams = msgspec.field(default_factory=WireSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] = 0
    rid: str | None = None
    stream: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    # one picture per run of image placeholder tokens in input_ids: data URLs or base64 (module docstring)
    image_data: str | list[str] | None = None

    def to_sampling(self) -> SamplingParams:
        return msgspec.structs.replace(
            self.sampling_params.to_sampling(),
            top_logprobs=self.top_logprobs_num,
            return_routed_experts=self.return_routed_experts,
        )


class DiskUpdateRequest(_Body):
    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class TensorUpdateRequest(_Body):
    serialized_named_tensors: list[bytes]  # base64 strings in JSON, raw bytes in msgpack
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitGroupRequest(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DistributedUpdateRequest(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str | None = None


class PauseRequest(_Body):
    mode: Literal["abort", "in_place", "retract", "keep", "wait"] = "abort"


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False


def finish_reason_dict(out: GenerateOutput, sampling: SamplingParams) -> dict[str, Any]:
    """SGLang's finish_reason shape: {"type": "stop", "matched": id} | {"type": "length", "length": n} | abort."""
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.output_ids[-1]}
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    return {"type": "abort", "message": "request aborted"}


def encode_routed_experts(rec: RoutedExperts, moe: MoeSpec, num_layers: int) -> dict[str, str]:
    """A RoutedExperts record (MoE layers only) -> SGLang's `meta_info` fields: all `num_layers` layers (dense
    layers' rows 0, as SGLang leaves them), int32, base64."""
    ids = routed_expert_ids(rec)
    full = np.zeros((ids.shape[0], num_layers, rec.topk), dtype=ROUTED_WIRE_DTYPES["int32"])
    full[:, moe.layers] = ids
    return {
        "routed_experts": base64.b64encode(full.tobytes()).decode("ascii"),
        "routed_experts_dtype": "int32",
    }


def decode_routed_experts(meta: dict[str, Any], moe: MoeSpec, num_layers: int) -> RoutedExperts:
    """SGLang's `meta_info.routed_experts` (base64, `routed_experts_dtype` or int32) -> the MoE layers' record.
    Raises ValueError when the payload does not fit `[positions, num_layers, topk]` or names no expert."""
    name = meta.get("routed_experts_dtype") or "int32"
    if name not in ROUTED_WIRE_DTYPES:
        raise ValueError(f"routed_experts_dtype {name!r} is not one of {', '.join(ROUTED_WIRE_DTYPES)}")
    flat = np.frombuffer(
        base64.b64decode(meta["routed_experts"], validate=True), dtype=ROUTED_WIRE_DTYPES[name]
    )
    row = num_layers * moe.topk
    if flat.size % row:
        raise ValueError(
            f"routed_experts: {flat.size} ids are not whole positions of {num_layers} x {moe.topk}"
        )
    ids = flat.reshape(-1, num_layers, moe.topk)[:, moe.layers]
    if ids.size and (ids.min() < 0 or ids.max() >= moe.experts):
        raise ValueError(f"routed_experts: expert ids outside [0, {moe.experts})")
    data = np.ascontiguousarray(ids, dtype=EXPERT_DTYPES[moe.expert_dtype]).tobytes()
    return RoutedExperts(layers=len(moe.layers), topk=moe.topk, dtype=moe.expert_dtype, data=data)


def generate_response(out: GenerateOutput, rid: str, return_logprob: bool, sampling: SamplingParams,
                      text: str | None = None, moe: MoeSpec | None = None, num_layers: int = 0
                      ) -> dict[str, Any]:  # fmt: skip
    """The `/generate` response body for one finished request (`moe`, `num_layers`: the served model's, for
    its routed experts)."""
    last_version = out.versions[-1][0] if out.versions else None
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason_dict(out, sampling),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": str(last_version) if last_version is not None else None,
        VERSIONS_KEY: [[v, n] for v, n in out.versions],
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(out.logprobs, out.output_ids, strict=True)
        ]
        if out.top_logprobs is not None:
            meta["output_top_logprobs"] = [[[lp, tok, None] for tok, lp in top] for top in out.top_logprobs]
    if out.routed_experts is not None and moe is not None:
        meta.update(encode_routed_experts(out.routed_experts, moe, num_layers))
    body: dict[str, Any] = {"output_ids": out.output_ids, "meta_info": meta}
    if text is not None:
        body["text"] = text
    return body


def integral_floats(value: Any) -> Any:
    """Decoded JSON with integral floats (5.0) made integers, recursively: JSON and JSON Schema count 5.0 as an
    integer, msgspec's typed decoding does not. For a second decode after a `got float` validation error."""
    if type(value) is float and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [integral_floats(v) for v in value]
    if isinstance(value, dict):
        return {k: integral_floats(v) for k, v in value.items()}
    return value


def parse_version(text: Any, default: int) -> int:
    """SGLang's weight_version is a free string ("default" until set); agentrl's are integers."""
    try:
        return int(text)
    except (TypeError, ValueError):
        return default


def parse_generate_response(body: dict[str, Any], default_version: int, moe: MoeSpec | None = None,
                            num_layers: int = 0) -> GenerateOutput:  # fmt: skip
    """SGLang (or serve-engine) `/generate` response -> GenerateOutput; raises KeyError/TypeError/ValueError if
    malformed. `moe`, `num_layers`: the served model's, to read `meta_info.routed_experts` (when present)."""
    meta = body["meta_info"]
    output_ids = list(body["output_ids"])
    logprobs = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(output_ids):
        raise ValueError(f"{len(logprobs)} logprobs for {len(output_ids)} output ids (return_logprob off?)")
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    finish = kind if kind in ("stop", "length", "abort") else "stop"
    runs = meta.get(VERSIONS_KEY)
    if runs is not None:
        versions = [(int(v), int(n)) for v, n in runs]
    else:
        version = parse_version(meta.get("weight_version"), default_version)
        versions = [(version, len(output_ids))] if output_ids else []
    tops = meta.get("output_top_logprobs")
    if tops is not None:
        tops = [[(int(t[1]), float(t[0])) for t in top or []] for top in tops]
        if len(tops) != len(output_ids):
            raise ValueError(f"{len(tops)} top-logprob lists for {len(output_ids)} output ids")
    routed = None
    if moe is not None and meta.get("routed_experts") is not None:
        routed = decode_routed_experts(meta, moe, num_layers)
    return GenerateOutput(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=finish,
        versions=versions,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        top_logprobs=tops,
        routed_experts=routed,
    )


# -- tensor payloads -------------------------------------------------------------------------------------------


def encode_safetensors(named_tensors: Any) -> bytes:
    """`(name, tensor)` pairs or a dict -> safetensors bytes (CPU, contiguous)."""
    from safetensors.torch import save

    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    return save({name: t.detach().to("cpu").contiguous() for name, t in items})


def decode_safetensors(payload: str | bytes) -> dict[str, Any]:
    from safetensors.torch import load

    data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
    return load(data)


def encode_sglang_tensors(named_tensors: Any) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(list_of_pairs, output_str=True)`: base64 of a
    ForkingPickler dump. CUDA tensors travel as IPC handles, so sender and server must share the GPU."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

    items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(items)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def error_body(message: str, field: str | None = None, status: int = 400) -> dict[str, Any]:
    err: dict[str, Any] = {"message": message, "code": status}
    if field:
        err["field"] = field
    return {"error": err}
