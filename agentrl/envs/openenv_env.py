"""`openenv`: an OpenEnv environment (Meta's `openenv-core`) played unchanged, over its own WebSocket client.

The server is either running already (`url`) or started here the way OpenEnv's templates serve an env app:
`python -m uvicorn <app> --host 127.0.0.1 --port <free port>`, one process per (app, cwd) in each agentrl
process, stopped at exit. Each episode opens its own client session (`/ws`; the server gives each session its
own env instance when the env sets `SUPPORTS_CONCURRENT_SESSIONS`).

Text in, text out: the observation's `observation_field` (else the observation's fields as JSON) is the
user message; the model's reply goes into the action's `action_field`. Rewards and `done` are OpenEnv's.
Pictures pass through: each field named in `image_fields` (a screenshot as a height x width x channels
array of 0-255, as BrowserGym's; a base64 image file or data URL; an empty field: no picture) becomes an
image part of the user message, before its text (agentrl/envs/pictures.py), and is left out of the JSON.

Failure is never a hang: every client call is bounded by `message_timeout_s` (connecting by
`connect_timeout_s`, a server start by `startup_timeout_s`); a timeout, a refused or dropped connection, a
server error or a server process that died raise `EnvError` naming the server, the call and the cause
(the rollout worker's env-error path). A server process found dead at `reset` is started again.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.pictures import content, image_file
from agentrl.envs.registry import pip_hint, register_env, require_extra
from agentrl.errors import EnvError
from agentrl.net import free_port
from agentrl.plugins import load_object
from agentrl.types import ImagePart, Message, TextPart


def _openenv() -> Any:
    require_extra(("openenv",), "openenv", "env 'openenv'")  # the one missing-extra line
    try:
        import openenv.core as core
    except ImportError as exc:
        raise EnvError(f"env 'openenv' needs openenv-core ({exc}): {pip_hint('openenv')}") from None
    return core


@dataclass
class _Server:
    app: str
    url: str
    process: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def why_dead(self) -> str:
        tail = self.log_path.read_text(errors="replace")[-1500:].strip() if self.log_path.exists() else ""
        return (
            f"server process {self.process.pid} ({self.app}) exited with code {self.process.returncode}"
            + (f"; its log ends: {tail}" if tail else "")
        )

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_servers: dict[tuple[str, str], _Server] = {}
_starting: dict[tuple[int, tuple[str, str]], asyncio.Lock] = {}  # per event loop: one start at a time


def _wait_quietly(process: subprocess.Popen, timeout_s: float) -> None:
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass


def stop_servers() -> None:
    """Stop every OpenEnv server this process started (also run at exit)."""
    while _servers:
        _servers.popitem()[1].stop()


atexit.register(stop_servers)


async def _start(app: str, cwd: str, startup_timeout_s: float) -> _Server:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="agentrl-openenv-", suffix=".log")[1])
    argv = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:  # the child keeps its own descriptor
        process = subprocess.Popen(argv, cwd=cwd or None, stdout=out, stderr=subprocess.STDOUT)
    server = _Server(app, f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + startup_timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            if not server.alive():
                raise EnvError(
                    f"openenv server for env.kwargs.app '{app}' did not start: {server.why_dead()}"
                )
            try:
                async with http.get(f"{server.url}/health") as resp:
                    if resp.status == 200:
                        return server
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
    server.stop()
    raise EnvError(
        f"openenv server for env.kwargs.app '{app}' was not healthy within "
        f"env.kwargs.startup_timeout_s = {startup_timeout_s}s (log: {log})"
    )


@register_env(name="openenv")
class OpenEnvEnv(AgentEnv):
    """An OpenEnv environment server, driven through its client: reset/step with text actions."""

    description = "an OpenEnv environment server (env.kwargs: app or url), driven through its client"

    def __init__(
        self,
        app: str = "",
        url: str = "",
        client: str = "",
        action_field: str = "message",
        observation_field: str = "",
        image_fields: list[str] | None = None,
        system_prompt: str = "",
        reset_kwargs: dict[str, Any] | None = None,
        max_turns: int = 8,
        cwd: str = "",
        message_timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        startup_timeout_s: float = 60.0,
    ):
        super().__init__(app=app, url=url, client=client, action_field=action_field,
                         observation_field=observation_field, image_fields=image_fields,
                         system_prompt=system_prompt,
                         reset_kwargs=reset_kwargs, max_turns=max_turns, cwd=cwd,
                         message_timeout_s=message_timeout_s, connect_timeout_s=connect_timeout_s,
                         startup_timeout_s=startup_timeout_s)  # fmt: skip
        if bool(app) == bool(url):
            raise EnvError(
                "env.kwargs for 'openenv': set exactly one of app ('module:app', started here) or url"
            )
        if ":" not in app and app:
            raise EnvError(
                f"env.kwargs.app = '{app}': expected 'module:attribute' (an ASGI app, as uvicorn takes)"
            )
        for key, value in (("message_timeout_s", message_timeout_s), ("connect_timeout_s", connect_timeout_s),
                           ("startup_timeout_s", startup_timeout_s), ("max_turns", max_turns)):  # fmt: skip
            if not value > 0:
                raise EnvError(f"env.kwargs.{key} = {value}: must be > 0")
        if image_fields is not None and (
            not isinstance(image_fields, list) or not all(isinstance(f, str) and f for f in image_fields)
        ):
            raise EnvError(f"env.kwargs.image_fields = {image_fields!r}: a list of observation field names")
        if not action_field:
            raise EnvError("env.kwargs.action_field: name the action field that takes the model's reply")
        core = _openenv()
        self.client_cls = load_object(client, "env.kwargs.client") if client else core.GenericEnvClient
        self.max_turns = max_turns
        self.session: Any = None
        self.where, self.url = url or app, url

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        """OpenEnv environments make their own episodes: a task is the seed passed to `reset`."""
        return [{"seed": seed * 1000 + i} for i in range(n)]

    async def _server_url(self) -> str:
        """The server's URL; the first episode of a process starts it, the others wait for that start."""
        if self.kwargs["url"]:
            return self.kwargs["url"]
        key = (self.kwargs["app"], self.kwargs["cwd"])
        server = _servers.get(key)
        if server is None or not server.alive():
            async with _starting.setdefault((id(asyncio.get_running_loop()), key), asyncio.Lock()):
                server = _servers.get(key)
                if server is None or not server.alive():
                    if server is not None:
                        server.stop()
                    server = _servers[key] = await _start(key[0], key[1], self.kwargs["startup_timeout_s"])
        return server.url

    async def _failure(self, call: str, exc: BaseException) -> EnvError:
        cause = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, asyncio.TimeoutError):
            cause = f"no reply within env.kwargs.message_timeout_s = {self.kwargs['message_timeout_s']}s"
        server = None if self.kwargs["url"] else _servers.get((self.kwargs["app"], self.kwargs["cwd"]))
        if server is not None:
            # a killed server drops the connection a moment before its exit status can be read
            await asyncio.to_thread(_wait_quietly, server.process, 1.0)
        dead = f"; {server.why_dead()}" if server is not None and not server.alive() else ""
        return EnvError(f"openenv server {self.where}: {call} failed: {cause}{dead}")

    async def _call(self, call: str, coro: Any) -> Any:
        try:
            return await asyncio.wait_for(coro, self.kwargs["message_timeout_s"])
        except EnvError:
            raise
        except Exception as exc:  # a dead or silent server surfaces as many exception types: name them all
            await self.close()
            raise await self._failure(call, exc) from exc

    def _content(self, observation: Any) -> str | list[TextPart | ImagePart]:
        """The user message of an observation: its text, after the pictures of its `image_fields`."""
        fields = observation if isinstance(observation, dict) else observation.model_dump(
            exclude={"reward", "done", "metadata"}
        )  # fmt: skip
        pictures = []
        for name in self.kwargs["image_fields"] or []:
            if name not in fields:
                raise EnvError(f"env.kwargs.image_fields: '{name}' is not a field of the observation "
                               f"(it has {sorted(fields)})")  # fmt: skip
            value = fields.pop(name)
            if value is not None and not (hasattr(value, "__len__") and len(value) == 0):
                pictures.append(image_file(value, f"openenv observation field '{name}'"))
        key = self.kwargs["observation_field"]
        if not key:
            return content(json.dumps(fields, ensure_ascii=False, default=str), pictures)
        if key not in fields:
            raise EnvError(f"env.kwargs.observation_field = '{key}': the observation has {sorted(fields)}")
        return content(str(fields[key]), pictures)

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        await self.close()
        self.url = await self._server_url()
        self.session = self.client_cls(base_url=self.url, connect_timeout_s=self.kwargs["connect_timeout_s"],
                                       message_timeout_s=self.kwargs["message_timeout_s"])  # fmt: skip
        kwargs = {**(self.kwargs["reset_kwargs"] or {}), **({"seed": task["seed"]} if "seed" in task else {})}
        result = await self._call("connect", self.session.connect())
        result = await self._call("reset", self.session.reset(**kwargs))
        system = [Message("system", self.kwargs["system_prompt"])] if self.kwargs["system_prompt"] else []
        return [*system, Message("user", self._content(result.observation))]

    async def step(self, action: str) -> StepResult:
        if self.session is None:
            raise EnvError("openenv env: step before reset")
        payload = {self.kwargs["action_field"]: action}
        if self.client_cls is not _openenv().GenericEnvClient:
            payload = self._typed_action(payload)
        result = await self._call("step", self.session.step(payload))
        reward = float(result.reward or 0.0)
        if result.done:
            return StepResult(reward=reward, done=True)
        return StepResult(messages=[Message("user", self._content(result.observation))], reward=reward)

    def _typed_action(self, payload: dict[str, Any]) -> Any:
        """A typed client's Action class, from its generic parameter (EnvClient[Action, Obs, State])."""
        for base in getattr(self.client_cls, "__orig_bases__", ()):
            args = getattr(base, "__args__", ())
            if args and isinstance(args[0], type):
                return args[0](**payload)
        raise EnvError(f"env.kwargs.client = '{self.kwargs['client']}': cannot find its Action class")

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            try:
                await asyncio.wait_for(session.disconnect(), self.kwargs["connect_timeout_s"])
            except Exception:  # closing a session of a dead server must not mask the real error
                pass
