"""A fake of SGLang 0.5.12's LoRA serving API over loopback HTTP, computing real log-probs (CPU tests only).

It checks what SGLang checks: the server was launched with `--enable-lora`, `--max-lora-rank`,
`--lora-target-modules` (the argv the launcher builds); `/load_lora_adapter` takes `lora_name` and `lora_path`
(`pinned`, `lora_id` optional; nothing else), refuses a name already loaded and an adapter whose rank exceeds
`max_lora_rank` or whose target modules the server was not launched for, answering `{"success": false,
"error_message": ...}` with HTTP 400 as SGLang does; `/unload_lora_adapter` takes `lora_name` of a loaded adapter;
`/generate` with `lora_path` must name a loaded adapter. Generation runs an embedded engine of the base model
with the requested adapter merged, read from the PEFT directory as SGLang reads it (config alpha / r scales B).
`hold` parks requests on one adapter until `release`, to keep them in flight across an update.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

from agentrl.engines.adapter import read_adapter_dir
from agentrl.engines.base import SamplingParams, TensorSource
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.sglang_launcher import sglang_argv

LOAD_FIELDS = {"lora_name", "lora_path", "pinned", "lora_id"}


def launched_flags(argv: list[str]) -> dict[str, list[str]]:
    """{flag: its values} of a launch argv (`--enable-lora` -> [], `--lora-target-modules q_proj v_proj` -> 2)."""
    flags: dict[str, list[str]] = {}
    key = None
    for arg in argv:
        if arg.startswith("--"):
            key = arg[2:]
            flags[key] = []
        elif key is not None:
            flags[key].append(arg)
    return flags


class FakeSGLangLora:
    def __init__(self, base: Path, server_args: dict):
        flags = launched_flags(sglang_argv("python", str(base), "127.0.0.1", 1, server_args))
        self.enabled = flags.get("enable-lora") == []
        self.max_rank = int(flags["max-lora-rank"][0]) if "max-lora-rank" in flags else 0
        self.targets = set(flags.get("lora-target-modules", []))
        self.engine = EmbeddedEngine(str(base), max_batch_size=2, max_seq_len=64)
        self.adapters: dict[str, list] = {}
        self.in_flight: dict[str, int] = {}
        self.events: list[tuple] = []
        self.violations: list[str] = []
        self.held: dict[str, asyncio.Event] = {}
        self._lock = asyncio.Lock()
        self._merged: str | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/load_lora_adapter", self.load)
        app.router.add_post("/unload_lora_adapter", self.unload)
        app.router.add_post("/generate", self.generate)
        return app

    def hold(self, name: str) -> None:
        self.held[name] = asyncio.Event()

    def release(self, name: str) -> None:
        self.held.pop(name).set()

    @staticmethod
    def _fail(message: str) -> web.Response:
        body = {"success": False, "error_message": message, "loaded_adapters": None}
        return web.json_response(body, status=400)

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not self.enabled:
            return self._fail("LoRA is not enabled (launch with --enable-lora)")
        if set(body) - LOAD_FIELDS or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
            return web.json_response({"detail": f"bad fields {sorted(body)}"}, status=422)
        if not isinstance(body.get("lora_path"), str) or not isinstance(body.get("pinned", False), bool):
            return web.json_response({"detail": "lora_path must be a string, pinned a bool"}, status=422)
        name = body["lora_name"]
        if name in self.adapters:
            return self._fail(f"The LoRA adapter {name} is already loaded")
        config = json.loads((Path(body["lora_path"]) / "adapter_config.json").read_text())
        if int(config["r"]) > self.max_rank:
            return self._fail(f"LoRA rank {config['r']} exceeds --max-lora-rank {self.max_rank}")
        modules = set(config["target_modules"])
        if "all" not in self.targets and not modules <= self.targets:
            return self._fail(f"target modules {sorted(modules - self.targets)} not in --lora-target-modules")
        self.adapters[name] = read_adapter_dir(body["lora_path"])
        self.events.append(("load", name))
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": {}})

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body.get("lora_name")
        if set(body) - {"lora_name", "lora_id"} or name not in self.adapters:
            return self._fail(f"LoRA adapter {name!r} is not loaded")
        if self.in_flight.get(name):
            self.violations.append(f"unloaded {name} with {self.in_flight[name]} requests in flight")
        del self.adapters[name]
        self.events.append(("unload", name))
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": {}})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body.get("lora_path")
        if name is not None and name not in self.adapters:
            return web.json_response({"error": {"message": f"LoRA adapter {name} not loaded"}}, status=400)
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        self.events.append(("generate", name))
        try:
            if name in self.held:
                await self.held[name].wait()
            sp = body["sampling_params"]
            sampling = SamplingParams(max_new_tokens=sp["max_new_tokens"], temperature=sp["temperature"],
                                      seed=sp.get("sampling_seed"), ignore_eos=True)  # fmt: skip
            async with self._lock:  # one adapter merged at a time
                if name != self._merged and name is not None:
                    await self.engine.update_weights(0, TensorSource(dict(self.adapters[name])))
                    self._merged = name
                out = await self.engine.generate(body["input_ids"], sampling)
        finally:
            self.in_flight[name] -= 1
        meta = {
            "output_token_logprobs": [
                [lp, t, None] for lp, t in zip(out.logprobs, out.output_ids, strict=True)
            ],
            "finish_reason": {"type": "length"},
            "weight_version": "default",  # the base weights' version: LoRA loads do not change it
            "prompt_tokens": len(body["input_ids"]),
        }
        return web.json_response({"output_ids": out.output_ids, "meta_info": meta})
