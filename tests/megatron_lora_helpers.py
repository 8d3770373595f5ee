"""Megatron LoRA vs torch + peft LoRA on the same start (shared by test_megatron_lora.py and its TP = 2 worker)."""

import torch

from agentrl.config.learning import AlgorithmSection, LearnerSection, LoraSection
from agentrl.learners.megatron import lora as mlora
from agentrl.learners.megatron.model import unwrap
from agentrl.learners.torch_learner import TorchLearner
from tests.megatron_helpers import make_batch

SETTINGS = dict(micro_batch_tokens=40, lr=1e-2, grad_clip=0.5, reference_model=True)
ALGO = dict(advantage="grpo", entropy_coef=0.01, kl_coef=0.1)


def lora_section(targets) -> LoraSection:
    return LoraSection(rank=4, alpha=8.0, target_modules=list(targets))


def torch_learner(path, targets, **kw) -> TorchLearner:
    lc = LearnerSection(lora=lora_section(targets), **{**SETTINGS, **kw})
    learner = TorchLearner(path, lc, AlgorithmSection(**ALGO))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B != 0: the first step moves A too, and the adapter changes the log-probs
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return learner


def peft_state(learner: TorchLearner) -> dict[str, torch.Tensor]:
    """The torch learner's adapter under peft's saved names (unscaled B), prefix removed."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(learner.model)
    return {k.removeprefix("base_model.model."): v.detach().clone() for k, v in state.items()}


def start_like(mega, ref: TorchLearner) -> None:
    """Give the Megatron learner the torch learner's adapter (each rank takes its TP shard)."""
    mlora.load(unwrap(mega.model), peft_state(ref), mega.tp_rank, mega.tp_size)
    if mega.cuda:  # the distributed optimizer's fp32 main params follow the model's
        mega.optimizer.reload_model_params()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:4]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def compare(mega, ref: TorchLearner, vocab: int) -> dict:
    """One train step of each from the same adapter: the numbers the tests bound."""
    start_like(mega, ref)
    probe = make_batch(vocab, seed=11)
    out = {
        "logprob_diff": (mega.compute_logprobs(probe) - ref.compute_logprobs(probe)).abs().max().item(),
        "ref_logprob_diff": (mega.compute_ref_logprobs(probe) - ref.compute_ref_logprobs(probe))
        .abs()
        .max()
        .item(),
    }
    start = peft_state(ref)
    a, b = mega.train_step(make_batch(vocab, seed=1)), ref.train_step(make_batch(vocab, seed=1))
    out["metrics"] = {k: [a[k], b[k]] for k in ("loss", "loss_kl", "grad_norm", "updates")}
    out["adapter_diff"] = max_diff(mlora.gather(unwrap(mega.model), scaled=False), peft_state(ref))
    out["adapter_moved"] = max_diff(start, peft_state(ref))
    out["published_diff"] = max_diff(dict(mega.published_weights()), dict(ref.published_weights()))
    ref_weights = dict(ref.weights())
    out["merged_diff"] = max((t - ref_weights[n]).abs().max().item() for n, t in mega.weights())
    out["after_logprob_diff"] = (
        (mega.compute_logprobs(probe) - ref.compute_logprobs(probe)).abs().max().item()
    )
    return out
