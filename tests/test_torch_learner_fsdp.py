"""The torch learner with FSDP2 (learner.fsdp) on 2 gloo ranks equals the single-process learner: loss, metrics,
updated weights, `weights()`, SFT, log-probs, and a save/load round trip (into FSDP and into a plain learner)."""

import os

import pytest
import torch

from agentrl.config import learner_ranks, load_config
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.engines.tiny import make_tiny_model
from agentrl.errors import ConfigError, LearnerError
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner
from agentrl.net import free_port
from tests.test_torch_learner import make_trajs

torch.set_num_threads(1)
ALGO = AlgorithmSection(advantage="grpo", entropy_coef=0.01, kl_coef=0.05)  # kl: the replicated reference


def learner_cfg(fsdp: bool) -> LearnerSection:
    # 32 tokens a micro-batch: several micro-batches, an odd count, so one rank runs a weight-0 filler
    return LearnerSection(lr=1e-2, micro_batch_tokens=32, fsdp=fsdp, grad_clip=0.5, reference_model=True)


def batches():
    return [build_batch(make_trajs(seed=s), pad_id=0) for s in (1, 2)]


def run_steps(learner: TorchLearner, out: dict, prefix: str) -> None:
    first, second = batches()
    out[f"{prefix}logprobs"] = learner.compute_logprobs(first)
    out[f"{prefix}metrics"] = learner.train_step(first)
    out[f"{prefix}weights"] = {k: v.clone() for k, v in learner.weights()}
    out[f"{prefix}sft"] = learner.sft_step(second)


def worker(rank: int, port: int, model: str, tmp: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    out: dict = {}
    learner = TorchLearner(model, learner_cfg(True), ALGO)
    assert learner.world.size == 2
    run_steps(learner, out, "")
    learner.save(f"{tmp}/ckpt")
    out["after_save"] = learner.train_step(batches()[0])
    resumed = TorchLearner(model, learner_cfg(True), ALGO)
    resumed.load(f"{tmp}/ckpt")
    out["resumed_counters"] = (resumed.step, resumed.policy_version)
    out["resumed"] = resumed.train_step(batches()[0])
    out["resumed_weights"] = dict(resumed.weights())
    from_plain = TorchLearner(model, learner_cfg(True), ALGO)  # a plain checkpoint (index-keyed optimizer)
    from_plain.load(f"{tmp}/plain_ckpt")
    out["from_plain"] = from_plain.train_step(batches()[0])
    out["from_plain_weights"] = dict(from_plain.weights())
    torch.save(out, f"{tmp}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def close_metrics(a: dict, b: dict, tol: float = 1e-5) -> None:
    for key in ("loss", "grad_norm", "tokens", "micro_batches"):
        assert abs(a[key] - b[key]) <= tol * max(1.0, abs(b[key])), (key, a[key], b[key])
    for key in a:
        if key.startswith("loss") or key.endswith(("_mean", "_frac", "_max", "_min")):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(b[key])), (key, a[key], b[key])


def test_fsdp_two_ranks_equals_single_process(tmp_path):
    import torch.multiprocessing as mp

    model = make_tiny_model(tmp_path / "tiny", "qwen2", seed=0, hidden=64, layers=2, vocab_size=512)
    port = free_port()
    ref: dict = {}
    single = TorchLearner(model, learner_cfg(False), ALGO)
    run_steps(single, ref, "")
    single.save(str(tmp_path / "plain_ckpt"))
    after_save = single.train_step(batches()[0])
    mp.spawn(worker, args=(port, str(model), str(tmp_path)), nprocs=2)

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for out in ranks:
        assert float((out["logprobs"] - ref["logprobs"]).abs().max()) <= 1e-5
        assert ref["metrics"]["micro_batches"] % 2 == 1  # the uneven split is exercised
        close_metrics(out["metrics"], ref["metrics"])
        assert max_diff(out["weights"], ref["weights"]) <= 1e-5  # weights() after one step, on every rank
        assert "lm_head.weight" not in out["weights"]  # tied embeddings: omitted as in the plain learner
        assert abs(out["sft"]["loss"] - ref["sft"]["loss"]) <= 1e-5
        close_metrics(out["after_save"], after_save)
        assert out["resumed_counters"] == (1, 1)  # one train_step; the sft_step leaves the version
        close_metrics(out["resumed"], out["after_save"], tol=1e-6)
        close_metrics(out["from_plain"], after_save)
    assert max_diff(ranks[0]["resumed_weights"], ranks[1]["resumed_weights"]) == 0.0
    for key in ("resumed_weights", "from_plain_weights"):  # the optimizer state came back too
        assert max_diff(ranks[0][key], dict(single.weights())) <= 1e-5, key

    plain = TorchLearner(model, learner_cfg(False), ALGO)  # an FSDP checkpoint loads into a plain learner
    plain.load(str(tmp_path / "ckpt"))
    assert (plain.step, plain.policy_version) == (1, 1)
    close_metrics(plain.train_step(batches()[0]), after_save)
    assert max_diff(dict(plain.weights()), dict(single.weights())) <= 1e-5


def test_fsdp_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"learner\.fsdp = true needs learner\.kind = 'torch'"):
        load_config(overrides={"learner": {"fsdp": True, "kind": "megatron"}})
    with pytest.raises(ConfigError, match=r"learner\.fsdp = true does not support algorithm\.advantage"):
        load_config(overrides={"learner": {"fsdp": True}, "algorithm": {"advantage": "gae"}})
    with pytest.raises(ConfigError, match=r"learner\.data_parallel = 2 .* needs learner\.fsdp = true"):
        load_config(overrides={"learner": {"data_parallel": 2}})
    with pytest.raises(ConfigError, match=r"run\.placement = 'colocated' runs one learner process"):
        load_config(
            overrides={"learner": {"data_parallel": 2, "fsdp": True}, "run": {"placement": "colocated"}}
        )
    assert learner_ranks(load_config(overrides={"learner": {"data_parallel": 2, "fsdp": True}})) == 2
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    # Earlier tests in this process may have left a default process group (a world of one): hide it.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    model = make_tiny_model(tmp_path / "tiny", "qwen2", seed=0, hidden=32, layers=1, vocab_size=128)
    with pytest.raises(LearnerError, match=r"learner\.fsdp"):
        TorchLearner(model, learner_cfg(True), ALGO)
