"""Engine construction from the config, and `EngineActor`: one engine served to other processes.

`make_engines(cfg, model_path)` builds the engines a process owns: embedded engines in this process, or
SGLang clients (each either to a server launched here by `SGLangServer` or to one of
`engine.external_urls`). `EngineActor` wraps one of them with plain async methods (agentrl.actors.remote makes
it a Ray actor); payloads arriving from the learner are turned into `WeightSource`s by
agentrl.actors.broadcast.

An engine actor whose engine is an HTTP client (SGLang, or `serve-engine` behind the same routes) names its
server in `http_route()`: rollout workers send generation there themselves
(agentrl.actors.router.RemoteEngine) and only control (pause, resume, weights, cache) comes to the actor. A
publish is then correct only if the server itself treats every client's requests as the update mode says, and
it does when the publish is one update request (`SGLangEngine.update_during_generation`): `abort` sends
SGLang's `abort_all_requests` (the server aborts every running request, its update lock waits for them to
return and holds new requests until the new weights are in: the aborted replies reach the workers, which
continue or re-run them), `keep` and `wait` send the update alone (SGLang's lock waits for the running
requests; serve-engine swaps weights between decode steps for `keep` and waits server-side for `wait`). Where
a request's state lives in the actor's client, the route is withheld and generation stays on Ray: an
in-process engine (embedded), a LoRA run (the adapter each request names, and when a retired one may be
unloaded, follow the client's own count of requests per adapter; SGLang's /load_lora_adapter neither aborts
nor waits), and on real SGLang a bucketed `nccl` publish (`learner.publish_bucket_mb > 0`) in `abort` or
`wait` mode: its parts are several update requests, each taking SGLang's lock alone, so only a pause keeps
requests off half-updated weights, and SGLang's own pause("abort") polls its lock once a second (about 1 s per
publish) where the actor's client, draining the requests it sent itself first, takes tens of milliseconds;
SGLang has no server-side "wait" pause at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrl.actors.images import ImageStore
from agentrl.config import Config
from agentrl.engines.base import Engine, GenerateOutput, SamplingParams, image_kwargs
from agentrl.engines.wire import SERVE_ENGINE
from agentrl.types import Image


def make_engine(cfg: Config, model_path: str, index: int = 0) -> Engine:
    e = cfg.engine
    if e.kind == "embedded":
        from agentrl.engines.embedded import EmbeddedEngine

        return EmbeddedEngine.from_config(
            e,
            model_path,
            seed=cfg.run.seed + 1000 * index,
            true_on_policy=cfg.run.true_on_policy,
            deterministic=cfg.run.deterministic,
        )
    from agentrl.engines.sglang import SGLangEngine

    timeouts = {"request_timeout_s": e.request_timeout_s, "update_timeout_s": e.update_timeout_s}
    if e.external_urls:
        return SGLangEngine(e.external_urls[index % len(e.external_urls)], model_path=model_path, **timeouts)
    from agentrl.engines.sglang_launcher import (
        SGLangServer,
        lora_server_args,
        routing_replay_server_args,
        vision_server_env,
    )

    # the user's own flags win
    args = {**lora_server_args(cfg.learner.lora), **routing_replay_server_args(cfg.learner), **e.sglang.args}
    if cfg.run.offload:  # /release_memory_occupation needs SGLang's torch_memory_saver; the CPU backup brings
        # back what a publish does not send (a LoRA run's base weights, buffers such as RoPE caches)
        args.setdefault("enable_memory_saver", True)
        args.setdefault("enable_weights_cpu_backup", True)
    trained_tower = cfg.learner.vision_tower == "trained" and not cfg.learner.lora.enabled
    server = SGLangServer(model_path, e.sglang, args=args, env=vision_server_env(trained_tower))
    engine = SGLangEngine(server.start(), model_path=model_path, **timeouts)
    engine._server = server  # type: ignore[attr-defined]  # kept alive with the client, stopped on close
    return engine


def make_engines(cfg: Config, model_path: str, count: int | None = None) -> list[Engine]:
    n = cfg.engine.num_engines if count is None else count
    return [make_engine(cfg, model_path, i) for i in range(max(1, n))]


@dataclass(frozen=True)
class HttpRoute:
    """What a rollout worker needs to send generate and abort to an engine actor's server itself: its `url`
    (None: generation goes through the actor, `why` says why), the Ray node the actor runs on (a loopback URL
    reaches the server from that node only), the actor's policy version (the stamp for a reply the server
    sends without a weight version: one before any update reached it) and the bearer token its client sends."""

    url: str | None
    why: str = ""
    node_id: str = ""
    policy_version: int = 0
    api_key: str = ""


def this_node() -> str:
    """The Ray node of this process ("" outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


class EngineActor:
    """One engine behind Ray: the `Engine` methods, plus weight updates from broadcast payloads."""

    def __init__(self, cfg: Config, model_path: str, index: int = 0):
        from agentrl.actors.common import set_threads

        set_threads(cfg)
        self.cfg = cfg
        self.index = index
        self.engine = make_engine(cfg, model_path, index)
        self.images = ImageStore()  # pictures sent once, then referred to by hash (agentrl.actors.images)

    async def http_route(self) -> HttpRoute:
        """Where rollout workers send generation themselves, or why they go through this actor (see the
        module docstring). A server must name its `weight_version` (/get_model_info): SGLang stamps a reply
        with it, and a worker's client has no other way to learn which version produced the reply."""
        from agentrl.engines.sglang import SGLangEngine

        engine = self.engine
        if not isinstance(engine, SGLangEngine):
            return HttpRoute(None, "the engine runs in the engine actor's process")
        if self.cfg.learner.lora.enabled:
            return HttpRoute(None, "LoRA: the engine actor's client names each request's adapter")
        info = await engine.model_info()
        if "weight_version" not in info:
            return HttpRoute(None, f"{engine.url} names no weight_version in /get_model_info")
        mode = self.cfg.effective_update_mode
        if mode != "keep" and info.get("engine") != SERVE_ENGINE and self._publishes_in_parts():
            why = {"abort": "SGLang's abort pause polls once a second while a request the engine actor's "
                            "client did not drain runs",
                   "wait": "SGLang has no pause that waits for running requests"}[mode]  # fmt: skip
            return HttpRoute(None, f"engine.update_mode = '{mode}' with a bucketed nccl publish on SGLang: its "
                             f"parts need a pause, and {why}")  # fmt: skip
        return HttpRoute(engine.url, "", this_node(), engine.policy_version, engine.api_key)

    def _publishes_in_parts(self) -> bool:
        """Whether a publish reaches this engine as several update requests (learner.publish_bucket_mb)."""
        from agentrl.actors.broadcast import choose_path

        return choose_path(self.cfg) == "nccl" and self.cfg.learner.publish_bucket_mb > 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                       images: list[Image] | None = None) -> GenerateOutput:  # fmt: skip
        """A request through Ray (the workers' path when `http_route` names no URL)."""
        images = self.images.unpack(images)
        return await self.engine.generate(input_ids, sampling, request_id, **image_kwargs(images))

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def pause(self, mode: str = "keep") -> None:
        await self.engine.pause(mode)  # type: ignore[arg-type]

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, version: int, payload: Any) -> int:
        from agentrl.actors.broadcast import load_into_engines

        await load_into_engines([self.engine], version, payload, self.cfg.effective_update_mode)
        return version

    async def flush_cache(self) -> None:
        await self.engine.flush_cache()

    async def init_weight_group(
        self, address: str, port: int, world_size: int, rank: int, group_name: str
    ) -> None:
        from agentrl.actors.broadcast import join_weight_group

        backend = "nccl" if "cuda" in self.cfg.engine.device else "gloo"
        await join_weight_group([self.engine], address, port, world_size, rank, group_name, backend)

    async def health(self) -> dict[str, Any]:
        return {"index": self.index, **(await self.engine.health())}

    async def policy_version(self) -> int:
        return self.engine.policy_version

    async def close(self) -> None:
        await self.engine.close()
        server = getattr(self.engine, "_server", None)
        if server is not None:
            server.stop()
