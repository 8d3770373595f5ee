"""Launch and supervise `python -m sglang.launch_server`, or attach to running servers.

Flag passthrough: `engine.sglang.args = {"mem_fraction_static": 0.7, "disable_radix_cache": true}` becomes
`--mem-fraction-static 0.7 --disable-radix-cache` (True -> bare flag, False/None -> omitted, lists -> repeated
values, dicts -> JSON). On the command line, `--sglang-mem-fraction-static 0.7` means the same
(`parse_sglang_flags`). The launcher owns --model-path, --host and --port; passing them in args is an error.
`SGLangServer.start()` blocks until /health_generate answers (startup_timeout_s); with restart_on_crash a
watcher thread restarts a server that exits on its own. The server's output goes to `log_path`; the server
runs in its own process group, which stop() terminates.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agentrl.config.learning import LoraSection
from agentrl.config.rollout import EngineSection, SGLangSection
from agentrl.errors import ConfigError, EngineError
from agentrl.net import free_port

MANAGED = {"model_path", "host", "port"}


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_sglang_flags(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Split `--sglang-<flag> [VALUE]` out of argv -> ({flag_with_underscores: value}, remaining argv)."""
    args: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--sglang-"):
            rest.append(arg)
            i += 1
            continue
        key, sep, value = arg[len("--sglang-") :].partition("=")
        key = key.replace("-", "_")
        if sep:
            args[key] = _value(value)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            args[key] = _value(argv[i + 1])
            i += 2
        else:
            args[key] = True
            i += 1
    return args, rest


def sglang_argv(python: str, model_path: str, host: str, port: int, args: dict[str, Any]) -> list[str]:
    """The launch command for one server (see the module docstring for the flag rules)."""
    argv = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
    ]
    for key, value in args.items():
        name = key.replace("-", "_")
        if name in MANAGED:
            raise ConfigError(
                f"engine.sglang.args.{key}: set by agentrl (use model.path / the launcher's port)"
            )
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def lora_server_args(lora: LoraSection) -> dict[str, Any]:
    """The SGLang flags that let a server load this LoRA section's adapters at run time (/load_lora_adapter)."""
    if not lora.enabled:
        return {}
    targets = ["all"] if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    return {"enable_lora": True, "max_lora_rank": lora.rank, "lora_target_modules": targets}


def routing_replay_server_args(learner: Any) -> dict[str, Any]:
    """The SGLang flag that makes a server return each request's routed experts, when `learner.routing_replay`
    is "rollout" (the learner replays the rollout's routing)."""
    return {"enable_return_routed_experts": True} if learner.routing_replay == "rollout" else {}


def vision_server_env(vision_tower_trained: bool) -> dict[str, str]:
    """The environment SGLang needs to serve a vision-language model as the learner computes it, less what the
    user's own environment sets (a text model reads neither variable, so every server gets them: a model given
    by a name SGLang resolves is covered too). SGLang keeps each picture's vision-tower output (100 MB by
    default, keyed by the picture alone) and no weight update clears it, so after a publish that changed the
    tower the pictures seen before would be read by the old tower: with a trained tower the cache is off
    (`SGLANG_VLM_CACHE_SIZE_MB=0`; the tower then runs once per request, a group's samples each); a frozen tower
    (or LoRA, which leaves it frozen) keeps it. `SGLANG_MM_AVOID_RETOKENIZE=1`: serve the ids sent, not their
    decode-and-tokenize-again (SGLang >= 0.5.13, where it is the default; set in case a user's turned it off)."""
    env = {"SGLANG_MM_AVOID_RETOKENIZE": "1"}
    if vision_tower_trained:
        env["SGLANG_VLM_CACHE_SIZE_MB"] = "0"
    return {k: v for k, v in env.items() if k not in os.environ}


SERVER_PORTS = (20_000, 55_000)  # SGLang also binds port + 10_000 (its gRPC port), which must stay <= 65_535


class SGLangServer:
    """One supervised SGLang server process (synchronous API; call it via asyncio.to_thread from async code).

    Settings come from `cfg` (engine.sglang); the keyword arguments override single fields. `env` adds
    variables (e.g. CUDA_VISIBLE_DEVICES).
    """

    def __init__(self, model_path: str, cfg: SGLangSection | None = None, host: str = "127.0.0.1",
                 port: int = 0, env: dict[str, str] | None = None, log_path: str | None = None,
                 max_restarts: int | None = None, python: str | None = None, args: dict[str, Any] | None = None,
                 startup_timeout_s: float | None = None, restart_on_crash: bool | None = None) -> None:  # fmt: skip
        cfg = cfg or SGLangSection()
        self.python = python or cfg.python or sys.executable
        self.args = dict(cfg.args if args is None else args)
        self.startup_timeout_s = cfg.startup_timeout_s if startup_timeout_s is None else startup_timeout_s
        self.restart_on_crash = cfg.restart_on_crash if restart_on_crash is None else restart_on_crash
        self.model_path, self.host = model_path, host
        self.port = port or free_port(host, SERVER_PORTS)
        # SGLang turns NCCL's cuMem off unless the variable is set, and NCCL's legacy-IPC P2P path then fails
        # with "Cuda failure 'invalid argument'" when the learner (cuMem on) broadcasts weights to it.
        self.env = {"NCCL_CUMEM_ENABLE": "1", **os.environ, **(env or {})}
        self.log_path = Path(log_path) if log_path else Path(f"sglang-{self.port}.log")
        self.max_restarts = cfg.max_restarts if max_restarts is None else max_restarts
        self.restarts = 0
        self.error: str | None = None
        self.argv = sglang_argv(self.python, model_path, host, self.port, self.args)
        self._proc: subprocess.Popen | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def start(self) -> str:
        """Spawn the server and block until /health_generate answers 200 (EngineError with the log tail if not)."""
        self._stopping.clear()
        self._spawn()
        if self.restart_on_crash and self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name=f"sglang-watch-{self.port}", daemon=True
            )
            self._watcher.start()
        return self.url

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log, self._lock:
            self._proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self._wait_healthy()

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health_generate", timeout=timeout_s) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            code = self._proc.poll()
            if code is not None:
                raise EngineError(
                    f"sglang server {self.url} exited with code {code} during start-up; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.25)
        self._terminate()
        raise EngineError(
            f"sglang server {self.url}: /health_generate not ready within engine.sglang.startup_timeout_s="
            f"{self.startup_timeout_s:g}s; log {self.log_path}:\n{self._log_tail()}"
        )

    def _watch(self) -> None:
        while not self._stopping.is_set():
            code = self._proc.wait()
            if self._stopping.is_set():
                return
            if self.restarts >= self.max_restarts:
                self.error = (
                    f"sglang server {self.url} crashed {self.restarts + 1} times; last exit code {code}"
                )
                return
            self.restarts += 1
            if self._stopping.wait(min(0.1 * 2.0**self.restarts, 5.0)):
                return
            try:
                self._spawn()
            except EngineError as exc:
                self.error = str(exc)
                return

    def _terminate(self, grace_s: float = 10.0) -> None:
        with self._lock:
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self._stopping.set()
        self._terminate()
        if self._watcher is not None:
            self._watcher.join(10)
            self._watcher = None


async def connect(
    cfg: EngineSection, model_path: str, log_dir: str = "."
) -> tuple[list[str], list[SGLangServer]]:
    """URLs of `engine.external_urls`, or of `engine.num_engines` launched servers (one GPU each, in order)."""
    if cfg.external_urls:
        return list(cfg.external_urls), []
    servers = []
    for i in range(cfg.num_engines):
        env = (
            {"CUDA_VISIBLE_DEVICES": str(i)} if cfg.device.startswith("cuda") and cfg.num_engines > 1 else {}
        )
        servers.append(SGLangServer(model_path, cfg.sglang, env=env, log_path=f"{log_dir}/sglang-{i}.log"))
    try:
        urls = list(await asyncio.gather(*(asyncio.to_thread(s.start) for s in servers)))
    except Exception:
        for server in servers:
            server.stop()
        raise
    return urls, servers
