"""run.true_on_policy: the embedded engine's reported log-prob of every sampled token equals, bit for bit, the
torch learner's training forward before its first update, whatever the engine batched meanwhile."""

import pytest
import torch

from agentrl import invariant, types
from agentrl.config import load_config
from agentrl.config.learning import LearnerSection
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.errors import ConfigError, EngineError, LearnerError
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner
from agentrl.runner.metrics import untimed
from tests.run_support import read_jsonl, tiny_config
from tests.workload_support import serve_workload

TEMPERATURE = 0.7
# (prompt length, new tokens, seconds after the first request it arrives): prompts of different lengths,
# prefilled together and alone, joining a decode batch that is already running, more than the 4 slots
WORKLOAD = [(3, 24, 0), (17, 6, 0), (40, 30, 0), (5, 12, 0), (61, 9, 0.05), (9, 20, 0.1), (26, 4, 0.1)]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model_dir(request, megatron_model):
    # qwen2: q/k/v biases; qwen3: q/k norms; 4 heads over 2 kv heads (GQA); vocab 300
    return megatron_model(request.param)


Served = list[tuple[list[int], list[float], types.Trajectory]]


def serve(model_dir, true_on_policy: bool, deterministic: bool = False, max_batch_size: int = 4,
          delays_s: list[float] | None = None) -> Served:  # fmt: skip
    """The workload through one engine: each request's prompt, the engine's log-probs of its sampled tokens and
    its trajectory (`delays_s`: each request's arrival instead of the workload's)."""
    torch.set_num_threads(2)
    engine = EmbeddedEngine(
        str(model_dir), max_batch_size=max_batch_size, max_seq_len=128, seed=1, true_on_policy=true_on_policy,
        deterministic=deterministic,
    )  # fmt: skip
    workload = (
        WORKLOAD if delays_s is None else [(n, m, d) for (n, m, _), d in zip(WORKLOAD, delays_s, strict=True)]
    )
    return [(p, o.logprobs, t) for p, o, t in serve_workload(engine, workload, TEMPERATURE)]


def learner_logprobs(model_dir, served, pack_tokens: int) -> list[torch.Tensor]:
    """The learner's log-probs of each trajectory's response tokens (one thread: the engine used two)."""
    torch.set_num_threads(1)
    learner = TorchLearner(
        str(model_dir), LearnerSection(kind="torch", micro_batch_tokens=150, reference_model=True),
        temperature=TEMPERATURE,
        true_on_policy=True,
    )  # fmt: skip
    batch = build_batch([t for _, _, t in served], pad_id=learner.pad_id, pack_tokens=pack_tokens)
    logp = learner.compute_logprobs(batch)
    assert torch.equal(learner.compute_ref_logprobs(batch), logp)  # the KL to the reference is exactly 0
    out = []
    for i, (prompt, _, _) in enumerate(served):
        row, cols = (batch.seq_index == i).nonzero(as_tuple=True)
        out.append(logp[row, cols][len(prompt) :])
    torch.set_num_threads(2)
    return out


def test_engine_logprobs_equal_learner_forward_bit_for_bit(model_dir):
    served = serve(model_dir, true_on_policy=True)
    assert [len(lp) for _, lp, _ in served] == [n for _, n, _ in WORKLOAD]
    for pack_tokens in (0, 100):  # right-padded rows, and sequences packed into shared rows
        learner = learner_logprobs(model_dir, served, pack_tokens)
        for i, ((_, engine_lp, _), lp) in enumerate(zip(served, learner, strict=True)):
            engine = torch.tensor(engine_lp, dtype=torch.float32)
            assert torch.equal(lp, engine), (i, pack_tokens, (lp - engine).abs().max().item())
    # the comparison can fail: the engine's normal kernels do not give the learner's bits
    normal = serve(model_dir, true_on_policy=False)
    learner = learner_logprobs(model_dir, normal, 0)
    assert any(not torch.equal(lp, torch.tensor(e)) for (_, e, _), lp in zip(normal, learner, strict=True))


def test_deterministic_engine_samples_whatever_the_batching(megatron_model):
    """run.deterministic's engine: the same requests, served in batches of 4 and arriving as the workload says, or
    in batches of 2 arriving in reverse order, sample the same tokens; without it they do not."""
    model = megatron_model("qwen2")
    reverse = [0.02 * (len(WORKLOAD) - i) for i in range(len(WORKLOAD))]
    for deterministic in (True, False):
        first, second = (
            [t.response_ids for _, _, t in serve(model, True, deterministic, size, delays)]
            for size, delays in ((4, None), (2, reverse))
        )
        assert (first == second) is deterministic


def test_ops_do_not_depend_on_the_batch():
    """Each op's row equals the row computed alone, for other row counts, positions and thread counts."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(70, 96, generator=gen),
        torch.randn(160, 96, generator=gen),
        torch.randn(160, generator=gen),
    )
    norm_w = torch.randn(96, generator=gen)
    alone = torch.cat([invariant.linear(x[i : i + 1], w, b) for i in range(70)])
    alone_norm = torch.cat([invariant.rms_norm(x[i : i + 1], norm_w, 1e-6) for i in range(70)])
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for a, n in ((0, 70), (5, 2), (17, 33)):
            assert torch.equal(invariant.linear(x[a : a + n], w, b), alone[a : a + n])
            assert torch.equal(invariant.rms_norm(x[a : a + n], norm_w, 1e-6), alone_norm[a : a + n])
    torch.set_num_threads(2)
    # attention: a decode row over its slot (keys past its position hold stale values; the slot read up to the
    # engine's rounded length, or whole) equals that token's row of a causal prefill of the whole sequence
    for length, dim, positions in ((45, 16, (0, 7, 31, 44)), (300, 64, (200, 299))):
        q, k, v = (torch.randn(length, 4, dim, generator=gen) for _ in range(3))
        k, v = k[:, :2], v[:, :2]
        full = invariant.causal_attention(q, k, v)
        slot_k = torch.cat([k, torch.randn(19, 2, dim, generator=gen)]).transpose(0, 1)[None]
        slot_v = torch.cat([v, torch.randn(19, 2, dim, generator=gen)]).transpose(0, 1)[None]
        for p in positions:
            rounded = -(-(p + 1) // 32) * 32
            for read in (rounded, slot_k.shape[2]):
                one = invariant.decode_attention(
                    q[p][None], slot_k[:, :, :read], slot_v[:, :, :read], torch.tensor([p])
                )
                assert torch.equal(one[0], full[p]), (length, p, read)
            assert torch.equal(invariant.causal_attention(q[: p + 1], k[: p + 1], v[: p + 1]), full[: p + 1])


def test_unsupported_settings_are_refused(megatron_model):
    for overrides, field in (
        ({"engine": {"kind": "sglang", "external_urls": ["http://x"]}}, "engine.kind"),
        ({"learner": {"kind": "megatron"}}, "learner.kind"),
        ({"engine": {"dtype": "bfloat16"}}, "engine.dtype"),
        ({"learner": {"lora": {"rank": 4}}}, "learner.lora.rank"),
        ({"engine": {"device": "cuda", "dtype": "bfloat16"}}, "engine.device and learner.device"),
        ({"engine": {"device": "cuda", "dtype": "bfloat16"}, "learner": {"device": "cuda"}}, "engine.dtype"),
    ):
        with pytest.raises(ConfigError, match=field):
            load_config(None, {"run": {"true_on_policy": True}, **overrides})
    # the GPU pair in bf16 (agentrl.invariant_triton's kernels) is accepted
    gpu = {"device": "cuda", "dtype": "bfloat16"}
    assert load_config(
        None, {"run": {"true_on_policy": True}, "engine": gpu, "learner": gpu}
    ).run.true_on_policy
    moe = megatron_model("qwen3_moe")
    with pytest.raises(EngineError, match="MoE"):
        EmbeddedEngine(str(moe), max_seq_len=64, true_on_policy=True)
    with pytest.raises(LearnerError, match="dense"):
        TorchLearner(str(moe), LearnerSection(kind="torch"), true_on_policy=True)
    with pytest.raises(LearnerError, match="gradient_checkpointing"):
        TorchLearner(
            str(megatron_model("qwen3")),
            LearnerSection(kind="torch", gradient_checkpointing=True),
            true_on_policy=True,
        )


@pytest.mark.slow
def test_runs_have_no_mismatch_and_replay(ray_session, tmp_path, run_model):
    """`agentrl run` (real Ray, warm-up, then RL with a weight publish after each step) with run.true_on_policy:
    train/logprob_mismatch is exactly 0 at every step. With run.deterministic two runs of one config (eight
    episodes in flight, each started after a random delay, so which requests share an engine batch differs
    between them; without run.deterministic such runs sample different tokens: the engine test below) write
    the same metrics.jsonl, times and throughputs aside."""
    from agentrl.runner.loop import run

    rows = []
    for name in ("first", "second"):
        root = tmp_path / name
        root.mkdir()
        path = tiny_config(
            root, run_model, run={"steps": 2, "eval_every": 0, "checkpoint_every": 0, "true_on_policy": True,
                                  "deterministic": True},
            rollout={"max_turns": 2, "temperature": 1.0, "concurrency": 8,
                     "generator": "tests.jitter_support:jittered_generate"},
        )  # fmt: skip
        assert run(load_config(path, []))["ok"]
        rows.append([untimed(m) for m in read_jsonl(root / "t" / "metrics.jsonl")])
    steps = [m for m in rows[0] if "phase" not in m]
    assert [m["train/logprob_mismatch"] for m in steps] == [0.0, 0.0]
    assert rows[0] == rows[1]
    with pytest.raises(ConfigError, match=r"run\.true_on_policy"):
        load_config(None, {"run": {"deterministic": True}})
