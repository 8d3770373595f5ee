"""LoRA in the torch learner: frozen base, adapter-only publish into the embedded engine, checkpoints, export."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl import types
from agentrl.cli import main as cli_main
from agentrl.config import load_config
from agentrl.config.learning import AlgorithmSection, LearnerSection, LoraSection
from agentrl.engines.base import SamplingParams, TensorSource
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.tiny import make_tiny_model
from agentrl.errors import ConfigError, LearnerError, WeightSyncError
from agentrl.learners.batch import build_batch
from agentrl.learners.checkpoint import read_metadata
from agentrl.learners.torch_checkpoint import STATE_FILE
from agentrl.learners.torch_learner import TorchLearner

torch.set_num_threads(2)
PROMPT = [3, 4, 5, 6]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora") / "m", "qwen3", seed=3, hidden=64, vocab_size=256)


def make_learner(path, rank=4, targets=("all-linear",), **kw):
    lora = LoraSection(rank=rank, alpha=8.0, target_modules=list(targets))
    return TorchLearner(path, LearnerSection(lr=2e-2, lora=lora, **kw), AlgorithmSection(advantage="rloo"))


def batch(learner, seed=0):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(4):
        resp = torch.randint(7, 200, (5,), generator=g).tolist()
        t = types.Trajectory(
            id=f"{seed}-{i}", group_id="g", prompt_ids=PROMPT, response_ids=resp, reward=float(i)
        )
        trajs.append(types.normalize(t))
    return build_batch(trajs, learner.pad_id)


def seq_logprobs(learner, prompt, output):
    t = types.normalize(
        types.Trajectory(id="x", group_id="x", prompt_ids=prompt, response_ids=output, reward=0.0)
    )
    b = build_batch([t], learner.pad_id)
    return learner.compute_logprobs(b)[0, len(prompt) : len(prompt) + len(output)]


def test_base_frozen_and_absent_from_optimizer(base):
    learner = make_learner(base)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" not in n}
    in_optimizer = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    named = dict(learner.model.named_parameters())
    assert in_optimizer == {id(p) for n, p in named.items() if "lora_" in n} and in_optimizer
    for step in range(2):
        learner.train_step(batch(learner, step))
    for name, p in learner.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, before[name]), name
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in named.items() if "lora_B" in n)


def test_adapter_learns_the_rewarded_responses(base):
    learner = make_learner(base, micro_batch_tokens=16, minibatches=2)  # micro-batches, two updates per step
    b = batch(learner, 9)
    learner._prepare(b)
    best, worst = [
        seq_logprobs(learner, PROMPT, b.input_ids[i, len(PROMPT) : 9].tolist()).sum() for i in (3, 0)
    ]
    for _ in range(3):
        learner.train_step(batch(learner, 9))
    after_best, after_worst = (
        seq_logprobs(learner, PROMPT, b.input_ids[i, len(PROMPT) : 9].tolist()).sum() for i in (3, 0)
    )
    assert after_best > best + 0.5 and after_worst < worst  # reward 3 up, reward 0 down
    assert learner.policy_version == 3


def test_reference_is_the_base_with_the_adapter_disabled(base):
    learner = make_learner(base, reference_model=True)
    assert learner.ref_model is learner.model  # no second copy
    learner.train_step(batch(learner))
    plain = TorchLearner(base, LearnerSection(), AlgorithmSection(advantage="rloo"))
    b = batch(learner, 5)
    assert (learner.compute_ref_logprobs(b) - plain.compute_logprobs(b)).abs().max() <= 1e-6
    assert (learner.compute_logprobs(b) - plain.compute_logprobs(b)).abs().max() > 1e-4


async def test_adapter_publish_gives_the_engine_the_learners_logprobs(base):
    learner = make_learner(base, targets=("q_proj", "v_proj", "down_proj"))
    engine = EmbeddedEngine(str(base), max_batch_size=4, max_seq_len=64)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    try:
        for version in (1, 2):  # the second version replaces the first adapter, it does not stack on it
            learner.train_step(batch(learner, version))
            stale = await engine.generate(PROMPT, sampling)
            drift = (
                (torch.tensor(stale.logprobs) - seq_logprobs(learner, PROMPT, stale.output_ids)).abs().max()
            )
            assert drift > 1e-4  # the engine still serves the previous version
            adapter = dict(learner.published_weights())
            assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
            await engine.update_weights(version, TensorSource(adapter))
            out = await engine.generate(PROMPT, sampling)
            expected = seq_logprobs(learner, PROMPT, out.output_ids)
            assert (torch.tensor(out.logprobs) - expected).abs().max() <= 1e-5
            assert out.versions == [(version, len(out.output_ids))]
    finally:
        await engine.close()


async def test_bad_adapter_is_refused_and_changes_nothing(base):
    engine = EmbeddedEngine(str(base), max_batch_size=2, max_seq_len=32)
    before = {n: t.clone() for n, t in engine.model.params.items()}
    name = "model.layers.0.self_attn.q_proj"
    bad = {f"{name}.lora_A.weight": torch.ones(4, 64), f"{name}.lora_B.weight": torch.ones(64, 3)}
    try:
        with pytest.raises(WeightSyncError, match=r"q_proj.*lora_B"):
            await engine.update_weights(1, TensorSource(bad))
        with pytest.raises(WeightSyncError, match="lora_A and lora_B"):
            await engine.update_weights(1, TensorSource({f"{name}.lora_A.weight": torch.ones(4, 64)}))
        assert all(torch.equal(t, before[n]) for n, t in engine.model.params.items())
        assert engine.policy_version == 0
    finally:
        await engine.close()


def test_checkpoint_holds_the_adapter_and_resumes_exactly(base, tmp_path):
    learner = make_learner(base)
    learner.train_step(batch(learner, 0))
    learner.save(str(tmp_path / "ck"))
    files = {p.name for p in (tmp_path / "ck").iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    state = torch.load(tmp_path / "ck" / STATE_FILE, weights_only=True)
    n_adapter = sum(p.numel() for p in learner._params())
    assert sum(s["exp_avg"].numel() for s in state["optimizer"]["state"].values()) == n_adapter
    assert read_metadata(tmp_path / "ck")["lora_base"] == str(base.resolve())
    resumed = make_learner(base)
    resumed.load(str(tmp_path / "ck"))
    assert resumed.policy_version == 1
    for learner_ in (learner, resumed):
        learner_.train_step(batch(learner_, 1))
    a, b = dict(learner.published_weights()), dict(resumed.published_weights())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    reopened = make_learner(tmp_path / "ck")  # a LoRA checkpoint as the model path: base from learner.json
    assert reopened.policy_version == 1
    with pytest.raises(LearnerError, match=r"learner\.lora\.rank"):
        TorchLearner(base, LearnerSection(), AlgorithmSection(advantage="rloo")).load(str(tmp_path / "ck"))


def test_export_merged_and_adapter(base, tmp_path):
    from peft import PeftModel

    learner = make_learner(base)
    for step in range(2):
        learner.train_step(batch(learner, step))
    learner.save(str(tmp_path / "ck"))
    ids = torch.tensor([[*PROMPT, 9, 10, 11, 12]])
    expected = seq_logprobs(learner, PROMPT, [9, 10, 11, 12])

    def logprobs(model):
        with torch.no_grad():
            logits = model(ids).logits.float()
        return torch.log_softmax(logits[0, len(PROMPT) - 1 : -1], -1).gather(-1, ids[0, len(PROMPT) :, None])[
            :, 0
        ]

    assert cli_main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    assert (logprobs(merged) - expected).abs().max() <= 1e-5
    assert cli_main(["export", str(tmp_path / "ck"), "--adapter", "--out", str(tmp_path / "adapter")]) == 0
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    base_model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")).eval()
    assert (logprobs(adapted) - expected).abs().max() <= 1e-5


def test_adapter_export_of_a_full_checkpoint_is_refused(base, tmp_path, capsys):
    TorchLearner(base, LearnerSection(), AlgorithmSection(advantage="rloo")).save(str(tmp_path / "ck"))
    assert cli_main(["export", str(tmp_path / "ck"), "--adapter", "--out", str(tmp_path / "a")]) != 0
    assert "not a LoRA checkpoint" in capsys.readouterr().err and not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["--learner.fsdp", "true", "--learner.data-parallel", "2"], "learner.fsdp = true is not supported"),
        (["--learner.lora.target-modules", "[]"], "learner.lora.target_modules"),
    ],
)
def test_conflicting_settings_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["--learner.lora.rank", "8", *overrides])


def test_unknown_target_module_is_named(base):
    with pytest.raises(LearnerError, match=r"learner\.lora\.target_modules = \['nope_proj'\]"):
        make_learner(base, targets=("nope_proj",))
