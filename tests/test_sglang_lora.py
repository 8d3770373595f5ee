"""LoRA publish to SGLang: each policy version's adapter is loaded by name (/load_lora_adapter), requests carry
`lora_path` = the current name and are stamped with its version, the previous adapter is unloaded only after its
in-flight requests returned; against a loopback fake of SGLang 0.5.12's LoRA API (tests/sglang_lora_fake.py)
that serves real log-probs from the PEFT directory the learner wrote."""

import asyncio

import pytest
import torch
from aiohttp import web

from agentrl.actors.broadcast import choose_path
from agentrl.config import load_config
from agentrl.config.learning import LoraSection
from agentrl.engines.base import AdapterSource, SamplingParams
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_launcher import lora_server_args, sglang_argv
from agentrl.engines.tiny import make_tiny_model
from agentrl.errors import ConfigError, WeightSyncError
from tests.sglang_lora_fake import FakeSGLangLora
from tests.test_lora import PROMPT, batch, make_learner, seq_logprobs

pytest.importorskip("peft")
torch.set_num_threads(2)
TARGETS = ("q_proj", "v_proj", "down_proj")
SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
EXTERNAL = ["--engine.kind", "sglang", "--engine.external-urls", '["http://127.0.0.1:1"]']


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("sgl-lora") / "m", "qwen3", seed=3, hidden=64, vocab_size=256
    )


@pytest.fixture
async def server(base):
    fake = FakeSGLangLora(base, lora_server_args(LoraSection(rank=4, target_modules=list(TARGETS))))
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()
    await fake.engine.close()


async def test_versions_load_by_name_route_requests_and_unload_after_in_flight(base, server, tmp_path):
    fake, url = server
    learner = make_learner(base, targets=TARGETS)
    engine = SGLangEngine(url, update_timeout_s=30)
    try:
        learner.train_step(batch(learner, 1))
        learner.save_adapter_dir(str(tmp_path / "v1"))
        await engine.update_weights(1, AdapterSource(str(tmp_path / "v1")))
        out = await engine.generate(PROMPT, SAMPLING)
        assert fake.events[-1] == ("generate", "agentrl-v1") and out.versions == [(1, 6)]
        assert (
            torch.tensor(out.logprobs) - seq_logprobs(learner, PROMPT, out.output_ids)
        ).abs().max() <= 1e-5

        fake.hold("agentrl-v1")
        in_flight = asyncio.ensure_future(engine.generate(PROMPT, SAMPLING))  # still on v1 during the update
        while fake.in_flight.get("agentrl-v1", 0) == 0:
            await asyncio.sleep(0.01)
        learner.train_step(batch(learner, 2))
        learner.save_adapter_dir(str(tmp_path / "v2"))
        await engine.update_weights(2, AdapterSource(str(tmp_path / "v2")))
        out2 = await engine.generate(PROMPT, SAMPLING)
        assert out2.versions == [(2, 6)] and ("unload", "agentrl-v1") not in fake.events
        assert (
            torch.tensor(out2.logprobs) - seq_logprobs(learner, PROMPT, out2.output_ids)
        ).abs().max() <= 1e-5
        fake.release("agentrl-v1")
        assert (await in_flight).versions == [(1, 6)]
        await asyncio.sleep(0.1)  # the unload follows the last v1 request
        assert [e for e in fake.events if e[0] != "generate"] == [
            ("load", "agentrl-v1"),
            ("load", "agentrl-v2"),
            ("unload", "agentrl-v1"),
        ]
        assert not fake.violations and set(fake.adapters) == {"agentrl-v2"}
        # a catch-up: the server has that version already (SGLang answers "already loaded")
        await engine.update_weights(2, AdapterSource(str(tmp_path / "v2")))
        assert fake.events.count(("load", "agentrl-v2")) == 1 and engine.policy_version == 2
    finally:
        await engine.close()


async def test_refused_adapter_names_the_route_and_the_reason(base, server, tmp_path):
    _, url = server
    learner = make_learner(base, rank=8, targets=TARGETS)  # the server was launched with --max-lora-rank 4
    learner.save_adapter_dir(str(tmp_path / "big"))
    engine = SGLangEngine(url, update_timeout_s=30, retries=0)
    try:
        with pytest.raises(WeightSyncError, match=r"/load_lora_adapter.*exceeds --max-lora-rank 4"):
            await engine.update_weights(1, AdapterSource(str(tmp_path / "big")))
        assert engine.policy_version == 0
    finally:
        await engine.close()


def test_launch_flags_and_config():
    argv = sglang_argv(
        "py", "M", "h", 1, lora_server_args(LoraSection(rank=8, target_modules=["q_proj", "v_proj"]))
    )
    assert argv[argv.index("--enable-lora") :] == [
        "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj",
    ]  # fmt: skip
    assert lora_server_args(LoraSection(rank=4, target_modules=["all-linear"]))["lora_target_modules"] == [
        "all"
    ]
    assert lora_server_args(LoraSection()) == {}
    cfg = load_config(None, ["--learner.lora.rank", "8", *EXTERNAL])
    assert (
        choose_path(cfg) == "disk"
        and cfg.effective_update_mode == "keep"
        and cfg.engine.update_mode == "auto"
    )
    with pytest.raises(ConfigError, match="publishes by 'disk'"):
        load_config(None, ["--learner.lora.rank", "8", "--learner.publish", "object_store", *EXTERNAL])
