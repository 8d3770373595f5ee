"""The LoRA publish path of the learner actor: only the adapter leaves the learner (object store and a gloo
broadcast in flattened buckets), its size is logged, and the embedded engine ends on the learner's logprobs."""

import asyncio
import logging
import threading

import torch

from agentrl.actors.broadcast import load_into_engines
from agentrl.actors.learner import LearnerWorker
from agentrl.config import load_config
from agentrl.engines.base import SamplingParams
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.tiny import make_tiny_model
from agentrl.net import free_port
from tests.test_lora import PROMPT, batch, seq_logprobs

torch.set_num_threads(2)


def worker(model_dir, *extra):
    cfg = load_config(None, ["--learner.lora.rank", "4", "--learner.lr", "0.02", *extra])
    return LearnerWorker(cfg, str(model_dir))


def test_object_store_payload_is_the_adapter_and_its_size_is_logged(tmp_path, caplog):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2", seed=4, hidden=64, vocab_size=256)
    w = worker(model_dir)
    full_bytes = sum(t.numel() * t.element_size() for _, t in w.learner.weights())
    with caplog.at_level(logging.INFO, logger="agentrl.actors.learner"):
        payload = w.weights_payload()
    assert set(payload) == {
        f"model.layers.{i}.self_attn.{m}_proj.lora_{ab}.weight" for i in range(2) for m in "qv" for ab in "AB"
    }
    assert w.last_publish_bytes == sum(t.numel() * t.element_size() for t in payload.values())
    assert w.last_publish_bytes * 20 < full_bytes
    assert f"{w.last_publish_bytes / 1e6:.3f} MB (LoRA adapter only)" in caplog.text


async def test_bucketed_broadcast_of_the_adapter_into_the_embedded_engine(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "qwen3", seed=5, hidden=64, vocab_size=256)
    w = worker(
        model_dir, "--learner.publish-bucket-mb", "0.002", "--learner.lora.target-modules", '["all-linear"]'
    )
    engine = EmbeddedEngine(str(model_dir), max_batch_size=2, max_seq_len=64)
    port = free_port()
    host = threading.Thread(target=w.init_weight_group, args=("127.0.0.1", port, 2, "lora"))
    host.start()
    await asyncio.to_thread(engine.init_weights_update_group, "127.0.0.1", port, 1, 2, "lora", "gloo")
    host.join(30)
    try:
        w.learner.train_step(batch(w.learner, 3))
        sources = w.distributed_source()
        assert len(sources) > 1 and all(".lora_" in n for s in sources for n in s.names)
        sender = asyncio.to_thread(w.broadcast_weights)
        await asyncio.gather(sender, load_into_engines([engine], 1, sources, "keep"))
        sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
        out = await engine.generate(PROMPT, sp)
        expected = seq_logprobs(w.learner, PROMPT, out.output_ids)
        assert (torch.tensor(out.logprobs) - expected).abs().max() <= 1e-5
        assert engine.policy_version == 1
    finally:
        await engine.close()


def test_buckets_never_split_an_adapter_pair():
    from agentrl.engines.weight_sync import plan_buckets

    items = []
    for i in range(5):
        items += [(f"m{i}.lora_A.weight", torch.zeros(4, 16)), (f"m{i}.lora_B.weight", torch.zeros(16, 4))]
    buckets = plan_buckets(items, 300)  # room for one 256-byte tensor: A alone would fill a bucket
    assert [n for b in buckets for n, _ in b] == [n for n, _ in items]
    assert all(len(b) == 2 and b[0][0].removesuffix("lora_A.weight") == b[1][0].removesuffix("lora_B.weight")
               for b in buckets)  # fmt: skip
