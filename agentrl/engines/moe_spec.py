"""The sparse layers of a mixture-of-experts model, read from its Hugging Face config (imports no torch).

qwen3_moe: softmax top-k router (`norm_topk_prob` renormalises the k weights), no shared expert, dense layers
where `mlp_only_layers` or `decoder_sparse_step` say. glm4_moe: sigmoid scores; `e_score_correction_bias` is
added only to choose the experts (the weights are the plain scores), choosing within the `topk_group` best of
`n_group` groups (a group scores the sum of its two best); weights scaled by `routed_scaling_factor`; a shared
expert on every token; the first `first_k_dense_replace` layers dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrl.errors import EngineError

MOE_ARCHS = ("qwen3_moe", "glm4_moe")


@dataclass
class MoeSpec:
    """The sparse layers of an MoE model: which layers route, and how."""

    experts: int
    topk: int
    intermediate: int  # each routed expert's
    layers: list[int]  # indices of the MoE layers, in model order (the others are dense)
    router: str  # "softmax" (Qwen3-MoE) or "sigmoid" (GLM-4.5: grouped, bias-corrected choice)
    norm_topk_prob: bool
    groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0
    shared_intermediate: int = 0  # the shared expert's (0: none)

    @property
    def expert_dtype(self) -> str:
        """The RoutedExperts dtype that holds this model's expert ids."""
        return "uint8" if self.experts <= 256 else "int16"


def moe_from_hf_config(cfg: dict[str, Any]) -> MoeSpec | None:
    """The MoE part of a Hugging Face config (None for a dense model). Torch-free: the SGLang client reads the
    MoE layer indices from it to cut SGLang's all-layer routing record down to the MoE layers."""
    model_type = cfg.get("model_type", "")
    n = cfg["num_hidden_layers"]
    if model_type == "qwen3_moe":
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
        layers = [i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0]
        router, shared, groups, topk_groups, scaling = "softmax", 0, 1, 1, 1.0
    elif model_type == "glm4_moe":
        experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
        layers = list(range(cfg.get("first_k_dense_replace", 0), n))
        router, groups, topk_groups = "sigmoid", cfg.get("n_group", 1), cfg.get("topk_group", 1)
        shared = cfg["moe_intermediate_size"] * cfg.get("n_shared_experts", 0)
        scaling = float(cfg.get("routed_scaling_factor", 1.0))
        if experts % groups:
            raise EngineError(
                f"config.json: n_routed_experts {experts} is not a multiple of n_group {groups}"
            )
    else:
        return None
    if not layers:
        return None
    return MoeSpec(
        experts=experts, topk=cfg["num_experts_per_tok"], intermediate=cfg["moe_intermediate_size"],
        layers=layers, router=router, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), groups=groups,
        topk_groups=topk_groups, scaling=scaling, shared_intermediate=shared,
    )  # fmt: skip
