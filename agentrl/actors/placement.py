"""Where each actor runs: Ray scheduling options per role, from `run.placement` and the `[run]` node settings.

- `colocated` / `split`: no placement group; every actor asks for 0 CPUs (the processes share the machine).
- `disaggregated`, `run.nodes = 1`: one `PACK` placement group with a bundle per learner rank, engine and
  rollout worker (a GPU per learner rank / engine when its device is cuda).
- `disaggregated`, `run.nodes > 1`: the run first waits for that many live Ray nodes, then places each role by
  its resources: the learner's ranks in `run.learner_nodes` `STRICT_PACK` groups (one per host, so a host's
  ranks share NVLink), the engines in `STRICT_PACK` groups of `run.engines_per_node`, the rollout workers in
  one `SPREAD` group. Each bundle also asks for its role's custom resources (`run.learner_resources`,
  `run.engine_resources`, `run.rollout_resources`), which is how a role is pinned to the nodes started with
  them (`ray start --resources '{"learner": 8}'`).
The queue actor always runs on the driver's node (`queue_options`): the run directory, its WAL and ledger are
on that node's disk, and every other actor reaches them through Ray or the queue's HTTP.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.actors.common import within
from agentrl.config import Config, learner_ranks
from agentrl.errors import ConfigError

NODES_POLL_S = 1.0


@dataclass
class Placement:
    """Ray options per actor of each role, and the placement groups that hold them (removed at shutdown)."""

    learner: list[dict[str, Any]]
    engines: list[dict[str, Any]] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)


def check(cfg: Config) -> None:
    """The node settings' own rules; each message names the settings."""
    r = cfg.run
    if r.nodes > 1 and r.placement != "disaggregated":
        raise ConfigError(
            f"run.nodes = {r.nodes} places actors over several nodes, which needs run.placement = "
            f"'disaggregated' (got '{r.placement}')"
        )
    ranks = learner_ranks(cfg)
    if r.nodes > 1 and ranks % r.learner_nodes:
        raise ConfigError(
            f"learner ranks ({ranks}) do not split evenly over run.learner_nodes = {r.learner_nodes}"
        )
    per_node = r.engines_per_node or cfg.engine.num_engines
    if r.nodes > 1 and cfg.engine.num_engines % per_node:
        raise ConfigError(
            f"engine.num_engines = {cfg.engine.num_engines} is not a multiple of run.engines_per_node = "
            f"{r.engines_per_node}"
        )


def queue_options() -> dict[str, Any]:
    """The queue actor on the driver's node, strictly: it writes the run directory there."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


async def place(cfg: Config) -> Placement:
    """Scheduling options for every actor of the run (see the module docstring)."""
    check(cfg)
    c = cfg
    if c.run.placement == "colocated":
        return Placement(learner=[{"num_cpus": 0}])
    if c.run.placement == "split":
        ranks = learner_ranks(c)
        return Placement(learner=[{"num_cpus": 0}] * ranks, workers=[{"num_cpus": 0}] * c.rollout.num_workers)
    if c.run.nodes > 1:
        await _wait_for_nodes(c.run.nodes, _timeout_s(c))
        return await _place_on_nodes(c)
    return await _place_on_one_host(c)


def _timeout_s(cfg: Config) -> float:
    return max(60.0, cfg.engine.sglang.startup_timeout_s)


def _gpus(cfg: Config) -> tuple[float, float]:
    """GPUs per learner rank and per engine."""
    learner = 1.0 if "cuda" in cfg.learner.device else 0.0
    engine = 1.0 if "cuda" in cfg.engine.device and not cfg.engine.external_urls else 0.0
    return learner, engine


def _cpu_per_bundle(cfg: Config) -> float:
    import ray

    n_bundles = learner_ranks(cfg) + cfg.engine.num_engines + cfg.rollout.num_workers
    return min(1.0, float(ray.cluster_resources().get("CPU", 1)) / n_bundles)


async def _place_on_one_host(cfg: Config) -> Placement:
    """One PACK group: learner ranks, engines, workers (the single-host layout)."""
    from ray.util.placement_group import placement_group

    ranks, engines, workers = learner_ranks(cfg), cfg.engine.num_engines, cfg.rollout.num_workers
    cpu, (learner_gpu, engine_gpu) = _cpu_per_bundle(cfg), _gpus(cfg)
    shapes = [(cpu, learner_gpu)] * ranks + [(cpu, engine_gpu)] * engines + [(cpu, 0.0)] * workers
    bundles = [{"CPU": s[0], **({"GPU": s[1]} if s[1] else {})} for s in shapes]
    pg = placement_group(bundles, strategy="PACK")
    await _ready(pg, bundles, cfg, "lower engine.num_engines / rollout.num_workers")
    options = [_in_bundle(pg, i, bundle) for i, bundle in enumerate(bundles)]
    return Placement(
        learner=options[:ranks],
        engines=options[ranks : ranks + engines],
        workers=options[ranks + engines :],
        groups=[pg],
    )


async def _place_on_nodes(cfg: Config) -> Placement:
    """STRICT_PACK groups per learner host and per engine host, one SPREAD group for the rollout workers."""
    r = cfg.run
    cpu, (learner_gpu, engine_gpu) = _cpu_per_bundle(cfg), _gpus(cfg)
    placement = Placement(learner=[])
    per_host = learner_ranks(cfg) // r.learner_nodes
    learner_bundle = _bundle(cpu, learner_gpu, r.learner_resources)
    for _ in range(r.learner_nodes):
        placement.learner += await _group(
            cfg, [learner_bundle] * per_host, "STRICT_PACK", placement, "learner"
        )
    per_node = r.engines_per_node or cfg.engine.num_engines
    engine_bundle = _bundle(cpu, engine_gpu, r.engine_resources)
    for _ in range(cfg.engine.num_engines // per_node):
        placement.engines += await _group(cfg, [engine_bundle] * per_node, "STRICT_PACK", placement, "engine")
    worker_bundle = _bundle(cpu, 0.0, r.rollout_resources)
    n = cfg.rollout.num_workers
    placement.workers = await _group(cfg, [worker_bundle] * n, "SPREAD", placement, "rollout")
    return placement


def _bundle(cpu: float, gpu: float, resources: dict[str, float]) -> dict[str, float]:
    return {"CPU": cpu, **({"GPU": gpu} if gpu else {}), **resources}


async def _group(cfg: Config, bundles: list[dict[str, float]], strategy: str, placement: Placement,
                 role: str) -> list[dict[str, Any]]:  # fmt: skip
    from ray.util.placement_group import placement_group

    pg = placement_group(bundles, strategy=strategy)
    placement.groups.append(pg)
    hint = f"start nodes with these resources, or change run.{role}_resources"
    await _ready(pg, bundles, cfg, hint)
    return [_in_bundle(pg, i, bundle) for i, bundle in enumerate(bundles)]


def _in_bundle(pg: Any, index: int, bundle: dict[str, float]) -> dict[str, Any]:
    """Options of an actor that takes the whole bundle `index` of `pg` (custom resources included)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    options = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0.0), "scheduling_strategy": strategy}
    return {**options, "resources": custom} if custom else options


async def _ready(pg: Any, bundles: list[dict[str, float]], cfg: Config, hint: str) -> None:
    import ray

    try:
        await within(pg.ready(), _timeout_s(cfg))
    except asyncio.TimeoutError:
        raise ConfigError(
            f"run.placement = 'disaggregated': the cluster cannot place bundles {bundles} "
            f"(have {ray.cluster_resources()}); {hint}"
        ) from None


async def _wait_for_nodes(nodes: int, timeout_s: float) -> None:
    """Until `nodes` Ray nodes are alive (worker nodes may join after the driver starts)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        if alive >= nodes:
            return
        if time.monotonic() > deadline:
            raise ConfigError(
                f"run.nodes = {nodes}, but {alive} Ray nodes joined within {timeout_s:.0f}s "
                "(start the workers with `ray start --address HEAD:6379`; docs/multinode.md)"
            )
        await asyncio.sleep(NODES_POLL_S)
