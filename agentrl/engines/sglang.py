"""`SGLangEngine`: the Engine interface over HTTP to an SGLang-dialect server (real SGLang or serve-engine).

Every call has a timeout and fails with EngineError (WeightSyncError for weight updates) naming the URL and
route. Versions: per-token runs from `meta_info.agentrl_versions` when the server sends them (serve-engine),
else every token is stamped with `meta_info.weight_version` (SGLang reports one version per request).
A weight update while requests run (`update_during_generation`, one source) is one request, so it treats every
client's requests alike, those of rollout workers sending straight to the server included: `abort` sends
SGLang's `abort_all_requests`: the server aborts every running request, its update lock waits (woken by each
request's end, no polling) until they have returned and holds new requests until the new weights are in (a
request SGLang is still preparing when the abort lands, its pictures being processed, is not aborted: the
update waits for it to finish); `wait` sends the update alone, whose lock waits for every running request to
finish (serve-engine: pause("wait") below, then the update). Pause modes (a bucketed publish, a LoRA adapter)
map to SGLang's: abort -> "abort" (after this client has aborted and drained its own requests, so SGLang's
once-a-second polling finds nothing running), keep -> "in_place"; "wait" stops this client sending and waits
for its in-flight requests, then pauses the server "in_place" (SGLang has no wait mode) or, on serve-engine,
with its own "wait", which waits for every other client's requests too.
Hot reload: /update_weights_from_disk, /update_weights_from_tensor (SGLang's pickled CUDA-IPC payload for
real SGLang on the same GPU; safetensors bytes for serve-engine), /init_weights_update_group +
/update_weights_from_distributed (NCCL broadcast from the trainer, rank 0). LoRA versions (an `AdapterSource`)
load by name through SGLang's LoRA serving API, each request routed to the current one (sglang_lora.py).
MoE routing replay: a request with `return_routed_experts` asks the server for its router's choices (SGLang must
run with --enable-return-routed-experts); SGLang answers every layer, so the client reads the model's
config.json (`model_path`, else the path /get_model_info names) to keep the MoE layers' rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from agentrl.engines import wire
from agentrl.engines.base import (
    AdapterSource,
    DiskSource,
    DistributedSource,
    Engine,
    GenerateOutput,
    InvalidRequest,
    PauseMode,
    SamplingParams,
    TensorSource,
    WeightSource,
)
from agentrl.engines.moe_spec import MoeSpec, moe_from_hf_config
from agentrl.engines.sglang_launcher import SGLangServer
from agentrl.engines.sglang_lora import LoraVersions, adapter_name
from agentrl.errors import EngineError, WeightSyncError
from agentrl.types import Image
from agentrl.vision import placeholder_runs

__all__ = ["SGLangEngine", "SGLangServer"]
log = logging.getLogger(__name__)
ABORT_POLL_S = 0.02  # pause("abort"): how often to re-send the abort while this client's requests drain


def _parse_body(text: str) -> Any:
    """JSON answer, or `{"text": ...}` (SGLang answers some control routes with plain text or nothing)."""
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return {"text": text}


@dataclass(frozen=True)
class TextOptions:
    stop: bool  # stop strings end the output (else it runs on, as the embedded engine's does)
    json_schema: bool  # structured output


class SGLangEngine(Engine):
    """Client of one server at `url`. `tensor_format`: "auto" (asks /get_model_info), "sglang" or "agentrl".
    `model_path`: the served model's directory, read for its MoE layers when routed experts are asked for."""

    def __init__(self, url: str, request_timeout_s: float = 300.0, update_timeout_s: float = 120.0,
                 policy_version: int = 0, tensor_format: str = "auto", tp_size: int = 1,
                 retries: int = 3, timeout_s: float | None = None, api_key: str | None = None,
                 model_path: str | None = None) -> None:  # fmt: skip
        import os

        self.api_key = os.environ.get("AGENTRL_ENGINE_TOKEN", "") if api_key is None else api_key
        if timeout_s is not None:  # alias of request_timeout_s
            request_timeout_s = timeout_s
        self.url = url.rstrip("/")
        self.request_timeout_s, self.update_timeout_s = request_timeout_s, update_timeout_s
        self.tensor_format, self.tp_size, self.retries = tensor_format, tp_size, retries
        self._version = policy_version
        self._session: aiohttp.ClientSession | None = None
        self._in_flight = 0
        self._drained: asyncio.Event | None = None
        self._gate: asyncio.Event | None = None
        self._paused: PauseMode | None = None
        self._lora = LoraVersions()
        self._kv_released = False  # between release_memory and resume_memory(["kv_cache"])
        self._unloads: set[asyncio.Task] = set()
        self.model_path = model_path
        self._moe: tuple[MoeSpec | None, int] | None = None  # the served model's MoE layers, once read
        self._config: dict | None = None  # the served model's config.json, once read (_model_config)
        self._text: TextOptions | None = None  # what the server does with text, once asked (text_options)
        self._serve_engine: bool | None = None  # whether the server is agentrl's serve-engine, once asked

    @property
    def policy_version(self) -> int:
        return self._version

    # -- transport -----------------------------------------------------------------------------------------------

    def _ensure(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True), headers=auth
            )
            self._gate, self._drained = asyncio.Event(), asyncio.Event()
            self._gate.set()
            self._drained.set()
        return self._session

    async def _call(self, method: str, route: str, body: Any = None, timeout_s: float | None = None,
                    error: type[EngineError] = EngineError) -> dict[str, Any]:  # fmt: skip
        """One request with retries on dropped connections; 4xx/5xx and timeouts raise `error` naming the route."""
        session = self._ensure()
        timeout_s = timeout_s or self.request_timeout_s
        where = f"{self.url}{route}"
        for attempt in range(self.retries + 1):
            try:
                async with session.request(
                    method, where, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
                ) as resp:
                    data = _parse_body(await resp.text())
                    if resp.status >= 400:
                        err = (data or {}).get("error") if isinstance(data, dict) else None
                        msg = (err or {}).get("message") if isinstance(err, dict) else None
                        if not msg and isinstance(data, dict):  # SGLang's LoRA routes answer error_message
                            msg = data.get("message") or data.get("error_message")
                        msg = msg or str(data)
                        if resp.status == 400 and route == "/generate":
                            raise InvalidRequest((err or {}).get("field") or "request", f"{where}: {msg}")
                        raise error(f"{where}: HTTP {resp.status}: {msg}")
                    if isinstance(data, dict) and data.get("success") is False:
                        raise error(
                            f"{where}: {data.get('message') or data.get('error_message') or 'failed'}"
                        )
                    return data if isinstance(data, dict) else {"data": data}
            except (
                aiohttp.ServerDisconnectedError,
                aiohttp.ClientConnectorError,
                aiohttp.ClientOSError,
            ) as exc:
                if attempt == self.retries:
                    raise error(f"{where}: {exc.__class__.__name__}: {exc}") from exc
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
            except asyncio.TimeoutError:
                raise error(f"{where}: no answer within {timeout_s:.0f}s") from None
        raise AssertionError("unreachable")

    # -- Engine API ----------------------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        images: list[Image] | None = None,
    ) -> GenerateOutput:
        self._ensure()
        # the model's MoE layout is read before sending, so a missing config fails before any generation
        moe, num_layers = await self._moe_layout() if sampling.return_routed_experts else (None, 0)
        if sampling.stop or sampling.json_schema is not None:
            text = await self.text_options()
            if sampling.json_schema is not None and not text.json_schema:
                raise InvalidRequest("sampling_params.json_schema", f"{self.url} serves no structured output "
                                     "(no grammar backend, or --skip-tokenizer-init)")  # fmt: skip
            if sampling.stop and not text.stop:  # as the embedded engine: it runs on, the caller cuts
                sampling = msgspec.structs.replace(sampling, stop=[])
        runs: list[tuple[int, int]] = []
        # the expanded prompt: what SGLang should serve once it has expanded each picture's placeholder again
        sent_tokens = len(input_ids)
        if images and not await self.serve_engine():
            runs = placeholder_runs(input_ids, await self._image_token_id())
            if len(runs) != len(images):  # SGLang would answer a bare 500 (its processor's count)
                raise InvalidRequest(
                    "image_data",
                    f"{len(runs)} image placeholder runs in input_ids for {len(images)} pictures: SGLang's processor "
                    "takes each run as one picture (a sampled image placeholder in an earlier turn reads as "
                    "another; agentrl's embedded engine serves such a token as text)",
                )
            input_ids = wire.collapse_image_runs(input_ids, runs)
        await self._gate.wait()
        body = wire.generate_body(input_ids, sampling, request_id, images)
        lora = self._lora.acquire()
        if lora is not None:
            body["lora_path"] = lora[0]  # SGLang looks the adapter up by name
        self._in_flight += 1
        self._drained.clear()
        try:
            data = await self._call("POST", "/generate", body)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()
            if lora is not None:
                self._unload_later(self._lora.release(lora[0]))
        try:
            out = wire.parse_generate_response(data, self._version, moe, num_layers)
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{self.url}/generate: malformed response ({exc!r})") from exc
        if runs and out.prompt_tokens and out.prompt_tokens != sent_tokens:
            raise EngineError(
                f"{self.url}/generate served a prompt of {out.prompt_tokens} tokens for the {sent_tokens} sent, so "
                "its reply answers another prompt than the one recorded: SGLang re-tokenized a prompt with images "
                "(before 0.5.13 it decodes the ids to text and tokenizes that again; use SGLang >= 0.5.13, which "
                "keeps the ids sent: SGLANG_MM_AVOID_RETOKENIZE, on by default), or its image processor made "
                "another number of tokens of a picture than the model directory's preprocessor_config.json says"
            )
        if moe is not None and out.routed_experts is None and out.finish_reason != "abort":
            raise EngineError(
                f"{self.url}/generate: routed experts were asked for and none came back (start SGLang with "
                "--enable-return-routed-experts)"
            )
        if lora is not None:  # the whole request ran on the adapter it was sent with
            out.versions = [(lora[1], len(out.output_ids))] if out.output_ids else []
        return out

    async def _model_config(self, why: str) -> dict:
        """The served model's config.json (read once; `why` names what needs it in the error)."""
        if self._config is None:
            from pathlib import Path

            path = self.model_path or (await self._call("GET", "/get_model_info")).get("model_path")
            config = Path(str(path)) / "config.json"
            try:
                self._config = json.loads(config.read_text())
            except (OSError, ValueError) as exc:
                raise EngineError(
                    f"{self.url}: {why}: cannot read the model's config.json at {config} ({exc}); give "
                    "the client the model directory (SGLangEngine model_path)"
                ) from None
        return self._config

    async def _moe_layout(self) -> tuple[MoeSpec | None, int]:
        """The served model's MoE layers and its layer count, from its config.json."""
        if self._moe is None:
            cfg = await self._model_config("routed experts")
            self._moe = (moe_from_hf_config(cfg), int(cfg["num_hidden_layers"]))
        return self._moe

    async def _image_token_id(self) -> int:
        """The served VLM's image placeholder token, from its config.json."""
        cfg = await self._model_config("images")
        if "image_token_id" not in cfg:
            raise InvalidRequest(
                "image_data", f"{self.url} serves a model without images (no image_token_id)"
            )
        return int(cfg["image_token_id"])

    async def abort(self, request_id: str) -> None:
        await self._call("POST", "/abort_request", {"rid": request_id})

    async def abort_all(self) -> None:
        await self._call("POST", "/abort_request", {"abort_all": True})

    async def pause(self, mode: PauseMode = "keep") -> None:
        self._ensure()
        if mode == "abort":
            await self._abort_and_drain()
            await self._call("POST", "/pause_generation", {"mode": "abort"})
        elif mode == "keep":
            await self._call("POST", "/pause_generation", {"mode": "in_place"})
        elif mode == "wait":
            self._gate.clear()
            try:
                await asyncio.wait_for(self._drained.wait(), self.request_timeout_s)
            except asyncio.TimeoutError:
                self._gate.set()
                raise EngineError(
                    f"{self.url}: pause('wait'): {self._in_flight} requests still running after "
                    f"{self.request_timeout_s:.0f}s"
                ) from None
            # serve-engine then waits for every other client's requests too; SGLang cannot
            server_mode = "wait" if await self.serve_engine() else "in_place"
            await self._call("POST", "/pause_generation", {"mode": server_mode}, self.request_timeout_s)
        else:
            raise InvalidRequest("mode", f"must be abort, wait or keep, got {mode!r}")
        self._paused = mode

    async def _abort_and_drain(self) -> None:
        """Abort every running request and wait, polling every `ABORT_POLL_S`, until this client's requests have
        returned, with new ones held at the gate. SGLang's own pause("abort") polls its request lock once a
        second, so it alone costs ~1 s per publish (bench/gpu/sglang_update_modes.py); called after this, it
        finds nothing running and returns at once."""
        self._gate.clear()
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        while self._in_flight:
            await self._call("POST", "/abort_request", {"abort_all": True})
            try:
                await asyncio.wait_for(self._drained.wait(), ABORT_POLL_S)
            except asyncio.TimeoutError:
                if asyncio.get_running_loop().time() > deadline:
                    self._gate.set()
                    raise EngineError(
                        f"{self.url}: pause('abort'): {self._in_flight} requests still running after "
                        f"{self.request_timeout_s:.0f}s"
                    ) from None

    async def drained(self, timeout_s: float) -> None:
        """Until none of this client's requests is in flight, or `timeout_s` has passed."""
        if self._drained is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout_s)

    async def resume(self) -> None:
        self._ensure()
        await self._call("POST", "/continue_generation", {})
        self._paused = None
        self._gate.set()

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache", {})

    async def release_memory(self) -> None:
        """SGLang gives back its weights, KV cache and CUDA graphs (needs --enable-memory-saver, an idle server)."""
        await self._call("POST", "/release_memory_occupation", {"tags": None}, self.update_timeout_s)
        self._kv_released = True  # SGLang flushed its cache before releasing it

    async def resume_memory(self, tags: list[str]) -> None:
        """'weights' (a weight update must follow: the contents are gone), 'kv_cache' (with its CUDA graphs)."""
        wanted = [t for tag in tags for t in (("kv_cache", "cuda_graph") if tag == "kv_cache" else (tag,))]
        await self._call("POST", "/resume_memory_occupation", {"tags": wanted}, self.update_timeout_s)
        if "kv_cache" in tags:
            self._kv_released = False

    async def health(self) -> dict[str, Any]:
        try:
            await self._call("GET", "/health_generate", timeout_s=min(30.0, self.request_timeout_s))
            return {"ok": True, "url": self.url, "policy_version": self._version}
        except EngineError as exc:
            return {"ok": False, "url": self.url, "error": str(exc), "policy_version": self._version}

    async def model_info(self) -> dict[str, Any]:
        return await self._call("GET", "/get_model_info")

    async def text_options(self) -> TextOptions:
        """What the server does with text (/get_server_info, asked once): stop strings need its tokenizer
        (SGLang's `--skip-tokenizer-init` has none: its scheduler would fail decoding a stop string's tail), and
        a JSON schema a grammar backend too (not `--grammar-backend none`; serve-engine has none)."""
        if self._text is None:
            info = await self._call("GET", "/get_server_info")
            tokenizer = not info.get("skip_tokenizer_init", False)
            grammar = info.get("grammar_backend") != "none"  # SGLang's default (None) is xgrammar
            self._text = TextOptions(stop=tokenizer, json_schema=tokenizer and grammar)
        return self._text

    @property
    def structured_output(self) -> bool:
        """Whether a JSON schema is served, as far as known (`text_options` asks; until then assumed)."""
        return self._text is None or self._text.json_schema

    # -- weights -------------------------------------------------------------------------------------------------

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> None:  # fmt: skip
        """Ask the server to join the trainer's broadcast group; the trainer (rank 0) must join concurrently."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._call("POST", "/init_weights_update_group", body, self.update_timeout_s, WeightSyncError)

    async def serve_engine(self) -> bool:
        """Whether the server is agentrl's serve-engine (/get_model_info's `engine`, asked once)."""
        if self._serve_engine is None:
            info = await self._call("GET", "/get_model_info", error=WeightSyncError)
            self._serve_engine = info.get("engine") == wire.SERVE_ENGINE
        return self._serve_engine

    async def _tensor_format(self) -> str:
        if self.tensor_format == "auto":
            self.tensor_format = "agentrl" if await self.serve_engine() else "sglang"
        return self.tensor_format

    async def _load_adapter(self, version: int, source: AdapterSource) -> None:
        """Load `version`'s adapter under its own name, route new requests to it, unload the previous one
        once its requests have returned."""
        name = adapter_name(version)
        body = {"lora_name": name, "lora_path": source.path, "pinned": False}
        try:
            await self._call("POST", "/load_lora_adapter", body, self.update_timeout_s, WeightSyncError)
        except WeightSyncError as exc:  # a catch-up of the version the server already has is not an error
            if "already loaded" not in str(exc):
                raise
        self._unload_later(self._lora.switch(version))
        self._version = version

    def _unload_later(self, name: str | None) -> None:
        if name is None:
            return
        task = asyncio.ensure_future(self._unload(name))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def _unload(self, name: str) -> None:
        try:
            await self._call("POST", "/unload_lora_adapter", {"lora_name": name}, self.update_timeout_s)
        except EngineError as exc:  # the adapter stays loaded (memory), generation is unaffected
            log.warning("%s: could not unload LoRA adapter %s: %s", self.url, name, exc)

    async def update_during_generation(self, version: int, source: WeightSource, mode: PauseMode) -> None:
        """One update request for `abort` (with `abort_all_requests`) and, on SGLang, `wait` (see the module
        docstring); it may wait for running requests, so its time limit is a request's and an update's. An
        adapter (its route aborts and waits for nothing) and `keep` go the base class's way."""
        if isinstance(source, AdapterSource) or mode == "keep" or self._paused is not None:
            await super().update_during_generation(version, source, mode)
        elif mode == "abort":
            await self._update(version, source, abort_all=True, timeout_s=self._drain_and_update_s)
        elif mode == "wait" and not await self.serve_engine():
            await self._update(version, source, timeout_s=self._drain_and_update_s)
        else:
            await super().update_during_generation(version, source, mode)

    @property
    def _drain_and_update_s(self) -> float:
        return self.request_timeout_s + self.update_timeout_s

    async def update_weights(self, version: int, source: WeightSource) -> None:
        if isinstance(source, AdapterSource):
            await self._load_adapter(version, source)
            return
        await self._update(version, source)

    async def _update(self, version: int, source: TensorSource | DiskSource | DistributedSource,
                      abort_all: bool = False, timeout_s: float | None = None) -> None:  # fmt: skip
        """Load full weights by the source's route; `abort_all`: the server first aborts every request."""
        # SGLang refuses to flush while requests sit in the running batch (in-place pause): keep their KV. No
        # flush either while the KV cache is released (the release flushed it; a flush would touch freed memory).
        common = {
            "weight_version": str(version),
            "flush_cache": self._paused != "keep" and not self._kv_released,
            "abort_all_requests": abort_all,
        }
        if isinstance(source, DiskSource):
            route, body = "/update_weights_from_disk", {"model_path": source.path, **common}
        elif isinstance(source, TensorSource):
            route = "/update_weights_from_tensor"
            if await self._tensor_format() == "agentrl":
                payload = await asyncio.to_thread(wire.encode_safetensors, source.tensors)
                import base64

                blob, load_format = base64.b64encode(payload).decode("ascii"), wire.AGENTRL_TENSOR_FORMAT
            else:
                blob, load_format = await asyncio.to_thread(wire.encode_sglang_tensors, source.tensors), None
            body = {"serialized_named_tensors": [blob] * self.tp_size, "load_format": load_format, **common}
        elif isinstance(source, DistributedSource):
            route = "/update_weights_from_distributed"
            body = {
                "names": source.names,
                "dtypes": source.dtypes,
                "shapes": source.shapes,
                "group_name": source.group_name,
                **common,
            }
            if source.extra.get("load_format"):
                body["load_format"] = source.extra["load_format"]
        else:
            raise WeightSyncError(f"unknown weight source {type(source).__name__}")
        await self._call("POST", route, body, timeout_s or self.update_timeout_s, WeightSyncError)
        self._version = version

    async def close(self) -> None:
        if self._unloads:
            await asyncio.gather(*self._unloads, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
