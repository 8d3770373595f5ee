"""The colocated memory hand-off (`run.offload`): the learner's state round-trips exactly through offload/onload,
the embedded engine frees and restores its KV cache, the hand-off calls engines and learner in the right order
and reports each phase's peak, SGLang gets the memory-occupation requests it takes, the config refuses what
it cannot do, and a colocated sync run trains with it (real Ray, tiny model)."""

import pytest
import torch
from aiohttp import web

from agentrl.actors.handoff import GIB, HandOff, PeakMeter, wait_until_free
from agentrl.config import load_config
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.engines.base import DiskSource, SamplingParams
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.tiny import make_tiny_model
from agentrl.errors import ConfigError
from agentrl.learners.offload import move_state
from agentrl.learners.torch_learner import TorchLearner
from tests.run_support import read_jsonl, tiny_config
from tests.test_lora import PROMPT, batch

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("handoff") / "m", "qwen3", seed=4, hidden=64, vocab_size=256
    )


def state(learner):
    params = {n: p for n, p in learner.model.named_parameters()}
    opt = [v for s in learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return params, opt


def test_offload_and_onload_round_trip_the_learner_exactly(base):
    make = lambda: TorchLearner(base, LearnerSection(lr=1e-2), AlgorithmSection(advantage="rloo"))  # noqa: E731
    moved, twin = make(), make()
    for learner in (moved, twin):
        learner.train_step(batch(learner, 0))
    params, opt = state(moved)
    before = {n: (p.detach().clone(), p.data_ptr()) for n, p in params.items()}
    opt_before = [(t.clone(), t.data_ptr()) for t in opt]
    moved.offload()
    params_off, opt_off = state(moved)
    cpu_ptrs = {n: p.data_ptr() for n, p in params_off.items()}
    assert params_off.keys() == params.keys() and all(
        params_off[n] is params[n] for n in params
    )  # same objects
    for name, p in params_off.items():
        value, ptr = before[name]
        # the step's gradients are dropped (never read again: each update starts with zero_grad(set_to_none))
        assert p.data_ptr() != ptr and torch.equal(p, value) and p.grad is None, name
    assert all(
        t.data_ptr() != ptr and torch.equal(t, v) for t, (v, ptr) in zip(opt_off, opt_before, strict=True)
    )
    moved.onload()
    for learner in (moved, twin):
        learner.train_step(batch(learner, 1))
    for (name, p), q in zip(moved.model.named_parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(p, q), name  # the Adam moments survived the trip: the next step is the same
    # the next offload refills the CPU copies of the first (no new host allocation) with the new values
    opt_cpu_ptrs = [t.data_ptr() for t in opt_off]
    values = {n: p.detach().clone() for n, p in moved.model.named_parameters()}
    moved.offload()
    params_again, opt_again = state(moved)
    for name, p in params_again.items():
        assert p.data_ptr() == cpu_ptrs[name] and torch.equal(p, values[name]), name
    assert [t.data_ptr() for t in opt_again] == opt_cpu_ptrs
    moved.onload()
    for learner in (moved, twin):
        learner.train_step(batch(learner, 2))
    for (name, p), q in zip(moved.model.named_parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_publish_offload_in_two_parts_moves_each_part_once_and_round_trips(base):
    """The hand-off's publish: gradients and optimizer state first (the weights stay for the update), then the
    weights; each tensor moves once, and training continues exactly after onload."""
    make = lambda: TorchLearner(base, LearnerSection(lr=1e-2), AlgorithmSection(advantage="rloo"))  # noqa: E731
    moved, twin = make(), make()
    for learner in (moved, twin):
        learner.train_step(batch(learner, 0))
    params, opt = state(moved)
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    opt_ptrs = [t.data_ptr() for t in opt]
    moved.offload(weights=False)
    assert all(p.data_ptr() == ptrs[n] and p.grad is None for n, p in params.items())
    assert all(t.data_ptr() != ptr for t, ptr in zip(state(moved)[1], opt_ptrs, strict=True))
    opt_off = [t.data_ptr() for t in state(moved)[1]]
    moved.offload(training_state=False)
    assert all(p.data_ptr() != ptrs[n] for n, p in params.items())
    assert [t.data_ptr() for t in state(moved)[1]] == opt_off  # the state moved once, not again
    moved.onload()
    for learner in (moved, twin):
        learner.train_step(batch(learner, 1))
    for (name, p), q in zip(moved.model.named_parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_training_state_leaves_while_the_weights_stay_on_another_device(base):
    """The publish moves the optimizer state off the GPU while the weights stay for the update. torch refuses a
    gradient on another device than its parameter (on the GPU: "attempting to assign a gradient with device type
    'cpu' to a tensor with device type 'cuda'"); here 'meta' stands for the other device."""
    learner = TorchLearner(base, LearnerSection(lr=1e-2), AlgorithmSection(advantage="rloo"))
    learner.train_step(batch(learner, 0))
    assert all(p.grad is not None for p in learner.model.parameters())
    move_state([learner.model], learner.optimizer, torch.device("meta"), weights=False)
    assert all(p.device.type == "cpu" and p.grad is None for p in learner.model.parameters())
    assert all(v.device.type == "meta" for v in state(learner)[1])


async def test_embedded_engine_frees_and_restores_its_kv_cache(base):
    engine = EmbeddedEngine(str(base), max_batch_size=2, max_seq_len=32)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        first = await engine.generate(PROMPT, sampling)
        full = engine.cache.nbytes()
        await engine.release_memory()
        assert all(t.untyped_storage().nbytes() == 0 for t in (*engine.cache.k, *engine.cache.v)) and full > 0
        await engine.resume_memory(["weights"])  # the weights never left: nothing to do
        await engine.resume_memory(["kv_cache"])
        assert sum(t.untyped_storage().nbytes() for t in (*engine.cache.k, *engine.cache.v)) == full
        again = await engine.generate(PROMPT, sampling)
        assert again.output_ids == first.output_ids and again.logprobs == first.logprobs
    finally:
        await engine.close()


class Recorder:
    """Learner and engines that log their hand-off calls into one list."""

    def __init__(self, log, name, on_offload=lambda: None):
        self.log, self.name, self.on_offload = log, name, on_offload

    def offload(self, weights=True, training_state=True):
        self.on_offload()
        self.log.append(
            ("offload", self.name, *(["weights"] * weights), *(["training_state"] * training_state))
        )

    def onload(self):
        self.log.append(("onload", self.name))

    async def release_memory(self):
        self.log.append(("release", self.name))

    async def resume_memory(self, tags):
        self.log.append(("resume", self.name, tuple(tags)))


async def test_handoff_order_and_phase_peaks():
    log, used = [], [0]
    meter = PeakMeter(interval_s=3600, read=lambda: used[0])

    async def wait_free():
        log.append(("wait_free",))
        return 0

    async def update():
        log.append(("update",))

    engines = [Recorder(log, "e0"), Recorder(log, "e1")]
    handoff = HandOff(Recorder(log, "learner", meter.sample), engines, meter, wait_free)
    try:
        await handoff.publish(update)  # the first publish: the learner starts offloaded
        taking = [("release", "e0"), ("release", "e1"), ("wait_free",), ("onload", "learner")]
        # the publish reads only the learner's weights: its training state leaves before the engines' weights return
        giving = [("offload", "learner", "training_state"), ("resume", "e0", ("weights",)),
                  ("resume", "e1", ("weights",)), ("update",), ("offload", "learner", "weights"),
                  ("resume", "e0", ("kv_cache",)), ("resume", "e1", ("kv_cache",))]  # fmt: skip
        assert log == taking + giving
        log.clear()
        used[0] = 30 * int(GIB)  # rollout: engines at full size
        meter.sample()
        used[0] = 5 * int(GIB)
        await handoff.to_training()
        await handoff.to_training()  # already training: nothing happens
        used[0] = 50 * int(GIB)  # training peak
        meter.sample()
        metrics = handoff.train_metrics()
        assert metrics["memory/rollout_peak_gib"] == 30 and metrics["memory/train_peak_gib"] == 50
        used[0] = 48 * int(GIB)  # the training state is still on the device while the publish moves it out

        async def loading():
            used[0] = 20 * int(GIB)  # the two models' weights: what the publish phase itself holds
            meter.sample()
            await update()

        log.clear()
        await handoff.publish(loading)
        assert log == giving
        assert (
            handoff.train_metrics()["memory/publish_peak_gib"] == 20
        )  # from the training state's leaving on
    finally:
        handoff.close()


async def test_wait_until_free_waits_for_the_release_to_settle():
    values, taken = [10, 8, 6, 5, 5, 5] + [5] * 10, []

    def read():
        taken.append(values[len(taken)])
        return taken[-1]

    assert await wait_until_free(read, settle_s=0.001, tolerance_bytes=0) == 5
    assert taken == [10, 8, 6, 5, 5, 5]  # it stopped at the third equal reading, not before


async def test_sglang_memory_occupation_requests():
    seen = []

    async def record(request):
        seen.append((request.path, await request.json()))
        return web.json_response({"success": True, "message": ""})

    app = web.Application()
    app.router.add_post("/release_memory_occupation", record)
    app.router.add_post("/resume_memory_occupation", record)
    app.router.add_post("/update_weights_from_disk", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine = SGLangEngine(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    try:
        await engine.release_memory()
        await engine.resume_memory(["weights"])
        await engine.update_weights(1, DiskSource("/new"))
        await engine.resume_memory(["kv_cache"])
        await engine.update_weights(2, DiskSource("/newer"))
    finally:
        await engine.close()
        await runner.cleanup()
    flush = [body["flush_cache"] for route, body in seen if route == "/update_weights_from_disk"]
    assert flush == [False, True]  # no cache flush while the KV cache is released
    assert [entry for entry in seen if entry[0] != "/update_weights_from_disk"] == [
        ("/release_memory_occupation", {"tags": None}),  # weights, KV cache and CUDA graphs
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
    ]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ([], "run.placement = 'colocated'"),
        (["--run.placement", "colocated", "--run.mode", "async"], "run.mode = 'sync'"),
        (["--run.placement", "colocated", "--learner.fsdp", "true"], "'torch' without learner.fsdp"),
    ],
)
def test_config_refuses_what_the_hand_off_cannot_do(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["--run.offload", "true", *overrides])


def test_async_at_staleness_0_may_offload():
    """Async with queue.max_staleness = 0 is the sync schedule (rollout and training take turns): allowed."""
    on = ["--run.offload", "true", "--run.placement", "colocated", "--run.mode", "async"]
    assert load_config(None, [*on, "--queue.max-staleness", "0"]).run.offload


def test_sglang_is_launched_with_the_memory_saver(monkeypatch):
    from agentrl.actors import engine as engine_mod
    from agentrl.engines import sglang_launcher

    launched = {}

    class Server:
        def __init__(self, model_path, cfg, args, env):
            launched.update(args)

        def start(self):
            return "http://127.0.0.1:1"

    monkeypatch.setattr(sglang_launcher, "SGLangServer", Server)
    cfg = load_config(None, ["--run.offload", "true", "--run.placement", "colocated", "--engine.kind", "sglang",
                             "--engine.device", "cuda", "--learner.lora.rank", "4"])  # fmt: skip
    engine_mod.make_engine(cfg, "M")
    assert launched["enable_memory_saver"] is True and launched["enable_weights_cpu_backup"] is True
    assert launched["enable_lora"] is True


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--engine.kind", "sglang", "--engine.device", "cuda", "--learner.device", "cuda"], True),
        (["--engine.kind", "sglang", "--engine.device", "cuda", "--learner.device", "cuda:0"], True),
        (
            ["--engine.kind", "embedded", "--learner.device", "cuda"],
            False,
        ),  # its CUDA graphs share the process
        (["--engine.kind", "sglang", "--engine.device", "cuda", "--learner.device", "cpu"], False),
    ],
)
def test_expandable_segments_only_where_the_learner_allocates_alone(overrides, expected):
    from agentrl.actors.colocated import expandable_segments

    on = ["--run.offload", "true", "--run.placement", "colocated", "--run.mode", "sync", *overrides]
    assert expandable_segments(load_config(None, on)) is expected
    assert not expandable_segments(load_config(None, ["--run.placement", "colocated", *overrides]))


@pytest.mark.slow
@pytest.mark.parametrize("learner", ["torch", "megatron"])
def test_colocated_sync_run_hands_the_device_over(ray_session, tmp_path, run_model, learner):
    from agentrl.runner.loop import run

    if learner == "megatron":
        pytest.importorskip("megatron.core")
    path = tiny_config(tmp_path, run_model, run={"steps": 2, "eval_every": 0})
    cfg = load_config(path, ["--run.placement", "colocated", "--run.mode", "sync", "--run.offload", "true",
                             "--learner.kind", learner])  # fmt: skip
    assert run(cfg)["ok"]
    steps = [
        m for m in read_jsonl(tmp_path / "t" / "metrics.jsonl") if "policy_version" in m and "phase" not in m
    ]
    assert [m["policy_version"] for m in steps] == [1, 2]
    for m in steps:  # every step went through the hand-off and reports its phases (0 GiB: no GPU here)
        assert {"memory/rollout_peak_gib", "memory/train_peak_gib", "handoff/to_training_s"} <= set(m)
        assert "memory/publish_peak_gib" in m and "handoff/publish_s" in m
    # the checkpoints were written between a publish and the next training, the learner offloaded: Megatron's
    # storages were then empty and its checkpoint unloadable ("Trying to resize storage that is not resizable")
    more = load_config(path, ["--run.placement", "colocated", "--run.mode", "sync", "--run.offload", "true",
                              "--learner.kind", learner, "--run.steps", "3"])  # fmt: skip
    assert run(more, resume=True)["ok"]
    steps = [
        m for m in read_jsonl(tmp_path / "t" / "metrics.jsonl") if "policy_version" in m and "phase" not in m
    ]
    assert [m["policy_version"] for m in steps] == [1, 2, 3]
