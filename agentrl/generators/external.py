"""`external`: episodes played by agent processes outside Ray (any language), over HTTP.

An ordinary generator: for each episode it resets the env, parks the task on this rollout worker's task
server and waits until an external agent has played it, then returns the episode's trajectory. So the run's
admission window, staleness bound and groups apply as to any generator (the `n_samples_per_prompt` episodes of
a task are parked with one `group_id`; the worker puts the finished group into the queue).

An agent's loop (generators/external_http_agent.py; URLs in runs/NAME/proxy.json, `task_servers`):
1. `GET /v1/tasks/next?wait_s=S` claims the oldest parked task (waits up to S <= 60 seconds; 204 when none):
   `{task_id, group_id, env, task, messages, base_url, max_turns}`. `messages` are the env's opening
   messages; `base_url` is an OpenAI base URL (`.../v1/sessions/<task_id>`) on the run's proxy.
2. It chats through `base_url` (any OpenAI client; tools, streaming, n as docs/agents.md says).
3. It ends the episode one of two ways:
   - `POST /v1/tasks/<id>/reward {"reward": x, "metadata": {...}?}`: the agent scores the episode itself;
   - `POST /v1/tasks/<id>/step {"action": text}`: the env scores it: the reply text is the env's action and
     the answer is `{messages, reward, done, info}`; the episode ends when the env says done (or after
     `rollout.max_turns` steps) with the env's episode reward (agentrl.generators.proxy_agent.episode_reward).
A claimed task with no request from its agent (task server or its proxy session) for
`rollout.external_timeout_s` ends as an `aborted` trajectory: what the session recorded, reward 0,
`metadata.abandoned` (with nothing recorded the worker drops it, as any empty trajectory).
Evaluation episodes (`run.eval_every`) are parked like training ones. `GET /v1/tasks` lists parked and
claimed tasks; `GET /health` answers without a token. With
`rollout.proxy_token` every other route (and the proxy) needs `Authorization: Bearer <token>`; a non-loopback
`rollout.proxy_host` without one is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import msgspec
from aiohttp import web

from agentrl.envs.base import AgentEnv
from agentrl.generator import RolloutContext
from agentrl.generators.proxy_agent import episode_reward, proxy_for, session_trajectory
from agentrl.net import FrontDoor, lacks_token
from agentrl.proxy.endpoints import record_endpoint
from agentrl.proxy.openai_schema import error_body
from agentrl.types import Trajectory, validation_field

MAX_WAIT_S = 60.0


class StepRequest(msgspec.Struct, forbid_unknown_fields=True):
    action: str


class RewardRequest(msgspec.Struct, forbid_unknown_fields=True):
    reward: float
    metadata: dict[str, Any] = {}


class TaskError(Exception):
    def __init__(self, status: int, message: str, param: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class Episode:
    task_id: str
    group_id: str
    task: dict[str, Any]
    env: AgentEnv
    messages: list[dict[str, str]]
    base_url: str
    max_turns: int
    claimed: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    last_seen: float = 0.0  # time.monotonic() of the agent's last request here
    steps: int = 0
    total: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def view(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "group_id": self.group_id, "env": self.env.name, "task": self.task,
                "messages": self.messages, "base_url": self.base_url, "max_turns": self.max_turns}  # fmt: skip


class TaskBoard(FrontDoor):
    """The parked and claimed episodes of one rollout worker, served over HTTP (routes in the docstring)."""

    what, how = "the external task server", "set rollout.proxy_token or make rollout.proxy_host 127.0.0.1"

    def __init__(self, token: str = "", read_timeout_s: float = 30.0):
        self.token, self.read_timeout_s = token, read_timeout_s
        self.parked: dict[str, Episode] = {}  # insertion order: oldest first
        self.claimed: dict[str, Episode] = {}
        self.arrived = asyncio.Condition()

    async def park(self, episode: Episode) -> None:
        async with self.arrived:
            self.parked[episode.task_id] = episode
            self.arrived.notify_all()

    def forget(self, episode: Episode) -> None:
        self.parked.pop(episode.task_id, None)
        self.claimed.pop(episode.task_id, None)

    async def claim(self, wait_s: float) -> Episode | None:
        async with self.arrived:
            if not self.parked:
                try:
                    await asyncio.wait_for(self.arrived.wait_for(lambda: bool(self.parked)), wait_s)
                except asyncio.TimeoutError:
                    return None
            episode = self.parked.pop(next(iter(self.parked)))
        self.claimed[episode.task_id] = episode
        episode.last_seen = time.monotonic()
        episode.claimed.set()
        return episode

    # -- HTTP ------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20, middlewares=[self._guard])
        app.router.add_get("/v1/tasks/next", self._next)
        app.router.add_get("/v1/tasks", self._list)
        app.router.add_post("/v1/tasks/{tid}/step", self._step)
        app.router.add_post("/v1/tasks/{tid}/reward", self._reward)
        app.router.add_get("/health", self._health)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if lacks_token(request, self.token, ("/health",)):
            resp = _error(TaskError(401, "missing or wrong bearer token", "Authorization"))
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        try:
            return await handler(request)
        except TaskError as exc:
            return _error(exc)

    async def _next(self, request: web.Request) -> web.Response:
        raw = request.query.get("wait_s", "0")
        try:
            wait_s = float(raw)
        except ValueError:
            raise TaskError(400, f"wait_s must be a number of seconds, got {raw!r}", "wait_s") from None
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise TaskError(400, f"wait_s must be in [0, {MAX_WAIT_S:.0f}]", "wait_s")
        episode = await self.claim(wait_s)
        if episode is None:
            return web.Response(status=204)
        return _json(episode.view())

    async def _list(self, request: web.Request) -> web.Response:
        return _json({"parked": list(self.parked), "claimed": list(self.claimed)})

    async def _health(self, request: web.Request) -> web.Response:
        return _json({"ok": True, "parked": len(self.parked), "claimed": len(self.claimed)})

    def _claimed(self, request: web.Request) -> Episode:
        tid = request.match_info["tid"]
        episode = self.claimed.get(tid)
        if episode is None:
            known = "parked, not claimed" if tid in self.parked else "unknown, finished or timed out"
            raise TaskError(404, f"task {tid!r} is {known}", "task_id")
        episode.last_seen = time.monotonic()
        return episode

    @contextlib.asynccontextmanager
    async def _open(self, request: web.Request, kind: type) -> AsyncIterator[tuple[Episode, Any]]:
        """The claimed episode and the decoded request, under the episode's lock, refused once it is over
        (the one place a step or a reward checks that)."""
        episode = self._claimed(request)
        req = await _decode(request, kind)
        async with episode.lock:
            if episode.done.done():
                raise TaskError(409, f"task {episode.task_id!r} is already finished", "task_id")
            yield episode, req

    async def _step(self, request: web.Request) -> web.Response:
        async with self._open(request, StepRequest) as (episode, req):
            result = await episode.env.step(req.action)
            episode.steps += 1
            episode.total += result.reward
            done = result.done or episode.steps >= episode.max_turns
            if done:
                episode.done.set_result((episode_reward(episode.total, result.info), {}))
        return _json({"messages": [msgspec.to_builtins(m) for m in result.messages], "reward": result.reward,
                      "done": done, "info": result.info})  # fmt: skip

    async def _reward(self, request: web.Request) -> web.Response:
        async with self._open(request, RewardRequest) as (episode, req):
            episode.done.set_result((req.reward, req.metadata))
        return _json({"task_id": episode.task_id, "reward": req.reward})


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def _error(exc: TaskError) -> web.Response:
    return web.Response(
        body=error_body(exc.message, exc.param), status=exc.status, content_type="application/json"
    )


async def _decode(request: web.Request, kind: type) -> Any:
    try:
        return msgspec.json.decode(await request.read(), type=kind)
    except msgspec.ValidationError as exc:
        raise TaskError(400, f"invalid request: {exc}", validation_field(exc)) from None
    except msgspec.DecodeError as exc:
        raise TaskError(400, f"request body is not valid JSON: {exc}") from None


# -- the generator -------------------------------------------------------------------------------------

_boards: dict[int, asyncio.Future] = {}


async def board_for(ctx: RolloutContext) -> TaskBoard:
    """This event loop's (rollout worker's) task server, started on first use."""
    key = id(asyncio.get_running_loop())
    future = _boards.get(key)
    if future is None:

        async def start() -> TaskBoard:
            board = TaskBoard(ctx.proxy_token)
            url = await board.start(ctx.proxy_host)
            record_endpoint(ctx.run_dir, bool(ctx.proxy_token), "task_servers", f"w{ctx.worker_id}", url,
                            f"external agents: GET {url}/v1/tasks/next")  # fmt: skip
            return board

        future = _boards[key] = asyncio.ensure_future(start())
    return await future


async def _outcome(episode: Episode, timeout_s: float, session: Any) -> tuple[float, dict[str, Any]] | None:
    """(reward, metadata) once the agent ends the episode; None once it has been silent for `timeout_s`
    (its last request to the task server or to its proxy session)."""
    await episode.claimed.wait()
    while True:
        last = max(episode.last_seen, getattr(session(), "last_used", 0.0))
        left = last + timeout_s - time.monotonic()
        if left <= 0:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(episode.done), left)
        except asyncio.TimeoutError:
            continue


async def generate(
    ctx: RolloutContext, task: dict[str, Any], trajectory_id: str, group_id: str
) -> Trajectory:
    board = await board_for(ctx)
    proxy = await proxy_for(ctx)
    sid = ctx.request_prefix or trajectory_id  # new for every attempt of the episode
    env = ctx.make_env()
    try:
        opening = [msgspec.to_builtins(m) for m in await env.reset(task)]
        episode = Episode(sid, group_id, task, env, opening, f"{proxy.base_url}/v1/sessions/{quote(sid, safe='')}",
                          max(1, ctx.max_turns))  # fmt: skip
        proxy.open_session(sid, ctx.sampling)  # the episode's sampling: greedy in evaluation
        await board.park(episode)
        try:
            outcome = await _outcome(episode, ctx.external_timeout_s,
                                     lambda: proxy.sessions.get(sid))  # fmt: skip
        finally:
            board.forget(episode)
    except BaseException:
        proxy.sessions.pop(sid, None)
        raise
    finally:
        await env.close()
    if outcome is None:
        meta = {
            "abandoned": True,
            "error": f"the agent was silent for {ctx.external_timeout_s}s",
        }
        return await session_trajectory(proxy, ctx, sid, 0.0, trajectory_id, group_id, "aborted", meta)
    reward, meta = outcome
    return await session_trajectory(proxy, ctx, sid, reward, trajectory_id, group_id, metadata=meta)
