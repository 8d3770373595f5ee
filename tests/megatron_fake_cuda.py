"""Drive the Megatron learner's GPU code path on CPU (used by test_megatron_ddp_cpu.py).

Megatron DDP, the distributed optimizer and the pipeline schedule only allocate with `device="cuda"` /
`torch.cuda.current_device()`, call `.cuda()` / `torch.cuda.synchronize()` and check `tensor.type()` for
"torch.cuda.*"; `fake_cuda()` maps those to CPU for the whole process, so the real Megatron classes
(DistributedDataParallel, DistributedOptimizer, finalize_model_grads, 1F1B schedule, p2p over gloo) run unchanged.
Never import this into a process that should keep real CUDA semantics: run it as a script or a spawned worker.
"""

import json
import os
import sys
import tempfile
import warnings

import torch
from torch.overrides import TorchFunctionMode

SETTINGS = dict(micro_batch_tokens=40, lr=1e-3, grad_clip=0.5)


class CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and isinstance(out, str) and ".cuda." not in out:
            return out.replace("torch.", "torch.cuda.", 1)
        return out


def fake_cuda() -> None:
    """Process-wide: Megatron's CUDA-only allocations and syncs run on CPU from here on."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    CudaOnCpu().__enter__()


def fake_cuda_streams() -> None:
    """Process-wide, after `fake_cuda()`: CUDA streams and events that do nothing (megatron's alltoall MoE token
    dispatcher copies its split sizes to the host on a side stream; on CPU everything is already there)."""
    import contextlib

    class Event:
        def synchronize(self) -> None:
            pass

    class Stream:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

        def record_event(self, *args) -> Event:
            return Event()

    default = Stream()
    torch.cuda.Stream = Stream
    torch.cuda.current_stream = lambda *args, **kwargs: default
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None
    # the dispatcher turns its split sizes into numpy arrays only when it copies them off a GPU; the collectives
    # take sizes, not tensors (under EP > 1 the all-to-all has splits)
    from megatron.core.transformer.moe import token_dispatcher

    to_cpu = token_dispatcher.maybe_move_tensor_to_cpu

    def host_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = host_sizes


def gpu_path_class():
    """MegatronLearner as built on a GPU (Megatron DDP + distributed optimizer), on CPU tensors (import after
    `fake_cuda()`)."""
    from agentrl.learners.megatron.learner import MegatronLearner

    class GpuPathLearner(MegatronLearner):
        def _check_device(self):  # CPU tensors, GPU code path
            pass

        def _make_optimizer(self):
            self.cuda = True
            return super()._make_optimizer()

    return GpuPathLearner


def gpu_path_learner(model_dir, tp: int = 1, pp: int = 1, gpu_path: bool = True, **learner_kw):
    """A MegatronLearner built as on a GPU (`gpu_path_class`), or the CPU learner itself (torch AdamW)."""
    from agentrl.config.learning import AlgorithmSection, LearnerSection
    from agentrl.learners.megatron.learner import MegatronLearner

    lc = LearnerSection(
        kind="megatron", tensor_parallel=tp, pipeline_parallel=pp, **{**SETTINGS, **learner_kw}
    )
    cls = gpu_path_class() if gpu_path else MegatronLearner
    return cls(model_dir, lc, AlgorithmSection(entropy_coef=0.01))


def compare_with_torch_learner(learner, model_dir, steps: int = 2, **learner_kw) -> dict:
    """Train `learner` and a TorchLearner (same `learner_kw`) on the same batches; the numbers a test compares."""
    from agentrl.config.learning import AlgorithmSection, LearnerSection
    from agentrl.learners.torch_learner import TorchLearner
    from tests.megatron_helpers import make_batch

    ref = TorchLearner(
        model_dir, LearnerSection(**{**SETTINGS, **learner_kw}), AlgorithmSection(entropy_coef=0.01)
    )
    probe = make_batch(300, seed=11)
    out = {"logprob_diff": (learner.compute_logprobs(probe) - ref.compute_logprobs(probe)).abs().max().item()}
    out["steps"] = []
    for step in range(steps):
        a, b = learner.train_step(make_batch(300, seed=step)), ref.train_step(make_batch(300, seed=step))
        out["steps"].append(
            {k: [a[k], b[k]] for k in ("loss", "grad_norm", "clip_frac", "updates", "mismatch_turn0")}
        )
    ref_weights = dict(ref.weights())
    out["weight_diff"] = max((t - ref_weights[n]).abs().max().item() for n, t in learner.weights())
    out["sft_loss"] = [
        learner.sft_step(make_batch(300, seed=5))["loss"],
        ref.sft_step(make_batch(300, seed=5))["loss"],
    ]
    return out


def single_process(model_dir: str) -> dict:
    """DP = 1 on the GPU path, plus a save/load resume."""
    from tests.megatron_helpers import make_batch

    learner = gpu_path_learner(model_dir)
    out = {"model": type(learner.model).__name__, "optimizer": type(learner.optimizer).__name__}
    out.update(compare_with_torch_learner(learner, model_dir))
    ckpt = tempfile.mkdtemp()
    learner.save(ckpt)
    again = gpu_path_learner(model_dir)
    again.load(ckpt)
    batch = make_batch(300, seed=9)
    out["reload_diff"] = (again.compute_logprobs(batch) - learner.compute_logprobs(batch)).abs().max().item()
    out["resumed_losses"] = [again.train_step(batch)["loss"], learner.train_step(batch)["loss"]]
    out["resumed_weight_diff"] = max(
        (x - y).abs().max().item() for (_, x), (_, y) in zip(again.weights(), learner.weights(), strict=True)
    )
    multi = dict(minibatches=2, epochs=2, lr=3e-3)  # 4 updates per batch: clipping acts
    out["multi"] = compare_with_torch_learner(gpu_path_learner(model_dir, **multi), model_dir, **multi)
    out["guard"] = non_finite_guard(gpu_path_learner(model_dir, minibatches=2))
    out["shard_copies"] = shard_copies(gpu_path_learner(model_dir, dtype="bfloat16"))
    out["offload"] = offload_round_trip(model_dir)
    out["host_reads"] = host_reads(model_dir)
    return out


def host_reads(model_dir) -> dict:
    """Calls that turn a tensor into a Python number or list (on a GPU: a host sync) during one train step, for
    one micro-batch and for several ({micro-batches: reads}), and those made after the optimizer's step began
    ("after_step": on a GPU they would leave it idle while the host prepares the next step)."""
    from tests.host_reads import counting_host_reads
    from tests.megatron_helpers import make_batch

    def not_the_fake_mode() -> bool:  # CudaOnCpu re-dispatches each read: count the caller's, not the echo
        frame = sys._getframe(1)
        while frame.f_code.co_name in ("counted", "after_step"):  # the counting's own frames
            frame = frame.f_back
        return frame.f_code.co_name != "__torch_function__"

    out = {"reads": {}, "after_step": 0}
    stepped = {"after": False}

    def after_step() -> bool:
        return stepped["after"] and not_the_fake_mode()

    for budget in (100_000, 40):
        learner = gpu_path_learner(model_dir, micro_batch_tokens=budget)
        learner.train_step(make_batch(300, seed=1))  # the first step builds the optimizer state
        batch = make_batch(300, seed=0)
        stepped["after"] = False
        step = learner.optimizer.step_with_ready_grads

        def marked(*args, _step=step, **kwargs):
            stepped["after"] = True
            return _step(*args, **kwargs)

        learner.optimizer.step_with_ready_grads = marked
        with counting_host_reads(not_the_fake_mode) as reads, counting_host_reads(after_step) as after:
            micro = learner.train_step(batch)["micro_batches"]
        out["reads"][int(micro)] = reads["n"]
        out["after_step"] += after["n"]
    return out


def offload_round_trip(model_dir) -> dict:
    """The hand-off on the GPU path (bf16 model, fp32 main shards, DDP buffers): the publish's two-part offload
    (training state, then weights) frees each storage once, onload restores it, and two offload/onload cycles
    leave training exactly where a twin that never moved is."""
    from agentrl.learners.megatron import handoff
    from tests.megatron_helpers import make_batch

    moved, twin = (gpu_path_learner(model_dir, dtype="bfloat16") for _ in range(2))
    sizes = lambda ts: [t.untyped_storage().nbytes() for t in ts]  # noqa: E731
    out = {"cycles": []}
    for step in range(2):
        for learner in (moved, twin):
            learner.train_step(make_batch(300, seed=step))
        weights, own = handoff.parts(moved)  # own: the training state less the views of the params
        moved.offload(weights=False)
        cycle = {"state_freed": bool(own) and all(n == 0 for n in sizes(own))}
        cycle["weights_kept"] = all(n > 0 for n in sizes(weights))
        moved.offload(training_state=False)
        cycle["weights_freed"] = all(n == 0 for n in sizes(weights))
        moved.onload()
        cycle["restored"] = all(n > 0 for n in sizes(weights + handoff.state_tensors(moved)))
        out["cycles"].append(cycle)
    for learner in (moved, twin):
        learner.train_step(make_batch(300, seed=7))
    out["weight_diff"] = max(
        (x - y).abs().max().item() for (_, x), (_, y) in zip(moved.weights(), twin.weights(), strict=True)
    )
    out["kept_copies"] = len(moved._offloader.kept)
    moved.reset_optimizer()  # the first moment zeroed in place: the next offload reuses the same CPU copies
    moved.train_step(make_batch(300, seed=8))
    moved.offload()
    moved.onload()
    out["kept_after_reset"] = len(moved._offloader.kept)
    return out


def shard_copies(learner) -> dict:
    """The batched shard copies (host_overhead.batch_shard_copies, bf16 model, fp32 main shards) against
    megatron's own per-parameter loops, after a real step and on perturbed main shards."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from tests.megatron_helpers import make_batch

    learner.train_step(make_batch(300, seed=0))
    opts = [o for o in learner.optimizer.chained_optimizers if isinstance(o, DistributedOptimizer)]
    out = {"patched": sum("_copy_main_params_to_model_params" in vars(o) for o in opts), "params": 0}
    params_equal = grads_equal = True
    for opt in opts:
        mains = [m for group in opt.shard_fp32_from_float16_groups + opt.shard_fp32_groups for m in group]
        model = [p for group in opt.model_float16_groups + opt.model_fp32_groups for p in group]
        for m in mains:
            m.data.add_(torch.randn_like(m) * 1e-2)
        opt._copy_main_params_to_model_params()  # batched
        fast = [p.detach().clone() for p in model]
        for group in opt.model_float16_groups:  # (the fp32 groups' main shards are views of the params)
            for p in group:
                p.data.zero_()
        DistributedOptimizer._copy_main_params_to_model_params(opt)  # megatron's loop
        params_equal &= all(torch.equal(a, p.detach()) for a, p in zip(fast, model, strict=True))
        opt._copy_model_grads_to_main_grads()
        fast_grads = [m.grad.clone() for m in mains]
        for m in mains:
            m.grad = None
        DistributedOptimizer._copy_model_grads_to_main_grads(opt)
        grads_equal &= all(torch.equal(a, m.grad) for a, m in zip(fast_grads, mains, strict=True))
        out["params"] += len(model)
        out["bf16"] = any(p.dtype == torch.bfloat16 for p in model)
    return {**out, "params_equal": params_equal, "grads_equal": grads_equal}


def non_finite_guard(learner) -> dict:
    """A NaN reward in the first mini-batch: that update is skipped, the weights stay finite."""
    from tests.megatron_helpers import make_batch

    before = {n: t.clone() for n, t in learner.weights()}
    batch = make_batch(300, seed=2)
    batch.rewards[0] = float("nan")
    m = learner.train_step(batch)
    after = dict(learner.weights())
    return {
        "updates_skipped": m.get("updates_skipped"),
        "finite": all(bool(t.isfinite().all()) for t in after.values()),
        "changed": any(not bool((before[n] == t).all()) for n, t in after.items()),
        "policy_version": learner.policy_version,
    }


def parallel_worker(rank: int, world: int, runs: list, port: int, out_dir: str) -> None:
    """One of `world` gloo ranks: for each (name, tp, pp, model_dir, gpu_path) train vs the torch learner."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fake_cuda()
    results = {}
    for name, tp, pp, model_dir, gpu_path in runs:
        results[name] = compare_with_torch_learner(gpu_path_learner(model_dir, tp, pp, gpu_path), model_dir)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def main() -> None:
    fake_cuda()
    from agentrl.engines.tiny import make_tiny_model

    path = make_tiny_model(f"{tempfile.mkdtemp()}/m", "qwen2", seed=3, hidden=64, layers=2, heads=4, kv_heads=2,
                           vocab_size=300, init_std=0.2, tie_embeddings=False)  # fmt: skip
    print(json.dumps(single_process(str(path))), flush=True)


if __name__ == "__main__":
    sys.exit(main())


def expert_parallel_worker(rank: int, world: int, model_dir: str, port: int, out_dir: str) -> None:
    """One of 2 gloo ranks on the GPU path: EP = 2 (each rank holds half the experts, grouped) against DP = 2
    without EP (sequential experts) and EP = 2 with the alltoall dispatcher on the same batches, a checkpoint
    and its resume, and the published weights against the HF files and the checkpoint's own HF conversion."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fake_cuda()
    fake_cuda_streams()  # the alltoall dispatcher's side stream
    from agentrl.learners.megatron import checkpoint
    from tests.megatron_helpers import hf_state, make_batch

    moe = dict(data_parallel=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    hf = hf_state(__import__("pathlib").Path(model_dir))

    def max_diff(a: dict, b: dict) -> float:
        assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
        return max((a[n].float() - b[n].float()).abs().max().item() for n in a)

    out: dict = {}
    ep = gpu_path_learner(model_dir, expert_parallel=2, **moe)
    from agentrl.learners.megatron import convert
    from agentrl.learners.megatron.model import unwrap

    out["local_experts"] = sorted(  # global expert numbers of this rank's routed experts (grouped: views)
        n.split("local_experts.")[1].split(".")[0]
        for n in convert.global_params(unwrap(ep.model))
        if "local_experts" in n
    )
    out["published_vs_hf"] = max_diff(dict(ep.weights()), hf)
    steps = [ep.train_step(make_batch(300, seed=step)) for step in range(2)]
    ckpt = os.path.join(out_dir, "ckpt")
    ep.save(ckpt)
    published = {n: t.clone() for n, t in ep.weights()}
    out["published_vs_checkpoint_hf"] = max_diff(published, dict(checkpoint.iter_checkpoint_hf(ckpt)))
    out["published_changed"] = max_diff(published, hf) > 0
    out["trained_logprobs"] = ep.compute_logprobs(make_batch(300, seed=11)).tolist()
    if rank == 0:  # `agentrl export`: an HF directory from the rank files alone
        checkpoint.to_hf(ckpt, os.path.join(out_dir, "export"))
    batch = make_batch(300, seed=9)
    resumed = gpu_path_learner(model_dir, expert_parallel=2, **moe)
    resumed.load(ckpt)
    out["resumed_losses"] = [resumed.train_step(batch)["loss"], ep.train_step(batch)["loss"]]
    out["resumed_weight_diff"] = max_diff(dict(resumed.weights()), dict(ep.weights()))
    # a warm-up batch of one micro-batch: rank 1 holds none, and still steps in lockstep with rank 0
    out["sft_one_micro_batch"] = ep.sft_step(make_batch(300, n=1, seed=5))["loss"]
    # the same 2 ranks, every expert on each, as megatron's SequentialMLP
    dp = gpu_path_learner(model_dir, expert_parallel=1, moe_experts="sequential", **moe)
    dp_steps = [dp.train_step(make_batch(300, seed=step)) for step in range(2)]
    out["steps"] = [
        {k: [a[k], b[k]] for k in ("loss", "grad_norm", "updates", "expert_load_max_over_mean")}
        for a, b in zip(steps, dp_steps, strict=True)
    ]
    a2a = gpu_path_learner(model_dir, expert_parallel=2, moe_token_dispatcher="alltoall", **moe)
    out["a2a_dispatchers"] = sorted(
        {type(m.token_dispatcher).__name__ for m in a2a.model.modules() if hasattr(m, "token_dispatcher")}
    )
    a2a_steps = [a2a.train_step(make_batch(300, seed=step)) for step in range(2)]
    out["a2a_steps"] = [
        {k: [a[k], b[k]] for k in ("loss", "grad_norm", "expert_load_max_over_mean")}
        for a, b in zip(a2a_steps, dp_steps, strict=True)
    ]
    del a2a
    out["ep_vs_dp_weights"] = max_diff(published, dict(dp.weights()))
    # the CPU learner (torch AdamW, gradients reduced by hand: experts over the expert-data-parallel group)
    cpu = gpu_path_learner(model_dir, gpu_path=False, expert_parallel=2, **moe)
    cpu_steps = [cpu.train_step(make_batch(300, seed=step)) for step in range(2)]
    out["cpu_steps"] = [
        {k: [a[k], b[k]] for k in ("loss", "grad_norm")} for a, b in zip(cpu_steps, dp_steps, strict=True)
    ]
    out["cpu_vs_dp_weights"] = max_diff(dict(cpu.weights()), dict(dp.weights()))
    # each rank trains on its own data-parallel slice, as in `agentrl run`: 6 rows (several micro-batches)
    # against 1 (one), so the rank with fewer runs lockstep passes in the update and in the log-prob passes
    mine = make_batch(300, n=6 if rank == 0 else 1, seed=20 + rank)
    out["sliced_uneven"] = ep.train_step(mine, sliced=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def moe_pipeline_worker(rank: int, world: int, model_dir: str, port: int, out_dir: str) -> None:
    """One of 2 gloo ranks: PP = 2 of a MoE model (megatron's alltoall dispatcher, as on GPU) against the torch
    learner: log-probs, losses and gradient norms of two steps, and every weight streamed under its HF name."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fake_cuda()
    fake_cuda_streams()
    from agentrl.config.learning import AlgorithmSection, LearnerSection
    from agentrl.learners.torch_learner import TorchLearner
    from tests.megatron_helpers import hf_state, make_batch

    learner = gpu_path_learner(model_dir, pp=2)
    dispatchers = {
        type(m.token_dispatcher).__name__ for m in learner.model.modules() if hasattr(m, "token_dispatcher")
    }
    ref = TorchLearner(model_dir, LearnerSection(**SETTINGS), AlgorithmSection(entropy_coef=0.01))
    probe = make_batch(300, seed=11)
    out = {"dispatchers": sorted(dispatchers)}
    out["logprob_diff"] = (learner.compute_logprobs(probe) - ref.compute_logprobs(probe)).abs().max().item()
    out["steps"] = []
    for step in range(2):
        a, b = learner.train_step(make_batch(300, seed=step)), ref.train_step(make_batch(300, seed=step))
        out["steps"].append({k: [a[k], b[k]] for k in ("loss", "grad_norm")})
    out["names"] = sorted(n for n, _ in learner.weights())
    out["hf_names"] = sorted(hf_state(__import__("pathlib").Path(model_dir)))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
