"""Drive the Megatron learner's GPU code path on CPU (run as a script by test_megatron_ddp_cpu.py).

Megatron DDP and the distributed optimizer only allocate with `device="cuda"` / `torch.cuda.current_device()`
and check `tensor.type()` for "torch.cuda.*"; a TorchFunctionMode maps those to CPU so the real Megatron
classes (DistributedDataParallel, DistributedOptimizer, finalize_model_grads) run unchanged. Prints one JSON line.
"""

import json
import sys
import tempfile
import warnings

import torch
from torch.overrides import TorchFunctionMode


class CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and isinstance(out, str) and ".cuda." not in out:
            return out.replace("torch.", "torch.cuda.", 1)
        return out


def fake_cuda() -> None:
    """Process-wide: Megatron's CUDA-only allocations and syncs run on CPU from here on."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    CudaOnCpu().__enter__()


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    fake_cuda()
    from agentrl.config import AlgorithmSection, LearnerSection
    from agentrl.engines.tiny import make_tiny_model
    from agentrl.learners.megatron.learner import MegatronLearner
    from agentrl.learners.torch_learner import TorchLearner
    from tests.test_megatron_learner import make_batch

    class GpuPathLearner(MegatronLearner):
        def _make_optimizer(self):
            self.cuda = True  # build Megatron DDP + distributed optimizer as on a GPU
            return super()._make_optimizer()

    tmp = tempfile.mkdtemp()
    path = make_tiny_model(f"{tmp}/m", "qwen2", seed=3, hidden=64, layers=2, heads=4, kv_heads=2, vocab_size=300,
                           init_std=0.2, tie_embeddings=False)  # fmt: skip
    algo = AlgorithmSection(entropy_coef=0.01)
    lc = LearnerSection(kind="megatron", micro_batch_tokens=48, lr=1e-3, grad_clip=0.5)
    mega = GpuPathLearner(path, lc, algo)
    ref = TorchLearner(path, LearnerSection(micro_batch_tokens=48, lr=1e-3, grad_clip=0.5), algo)
    out = {"model": type(mega.model).__name__, "optimizer": type(mega.optimizer).__name__, "steps": []}
    for step in range(2):
        a, b = mega.train_step(make_batch(300, seed=step)), ref.train_step(make_batch(300, seed=step))
        out["steps"].append({k: [a[k], b[k]] for k in ("loss", "grad_norm", "entropy")})
    ref_weights = dict(ref.weights())
    out["weight_diff"] = max((t - ref_weights[n]).abs().max().item() for n, t in mega.weights())
    mega.save(f"{tmp}/ck")
    again = GpuPathLearner(path, lc, algo)
    again.load(f"{tmp}/ck")
    batch = make_batch(300, seed=9)
    out["reload_diff"] = (again.compute_logprobs(batch) - mega.compute_logprobs(batch)).abs().max().item()
    out["resumed_losses"] = [again.train_step(batch)["loss"], mega.train_step(batch)["loss"]]
    out["resumed_weight_diff"] = max(
        (x - y).abs().max().item() for (_, x), (_, y) in zip(again.weights(), mega.weights(), strict=True)
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
