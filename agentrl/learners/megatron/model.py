"""Build a megatron-core GPTModel that computes what a Hugging Face Qwen2 / Qwen3 / Llama model computes.

Invariants: `ArchSpec.from_hf(config)` (arch.py) is the only place that reads HF config fields; every
architectural choice Megatron needs (qkv and o_proj biases, qk-norm, GQA groups, head_dim, RoPE theta and llama3
scaling, RMSNorm eps, SwiGLU, tied embeddings) is derived from it, and anything it cannot express raises
LearnerError naming the field. Megatron ties the o_proj bias to `add_bias_linear`, which would also give the
MLP biases, so an o_proj bias without MLP biases swaps in a linear_proj class that always has one. Layer spec: Transformer Engine when importable, else the local (pure torch) spec, whose core attention
is replaced by `SDPAttention` (torch scaled_dot_product_attention, causal; flash kernels on GPU) unless
attention="local" asks for Megatron's own DotProductAttention. Batches are right-padded, so a causal mask
alone is exact for every real token and RoPE positions are 0..T-1.
Mixtures of experts (Qwen3-MoE, GLM-4.5-MoE): a per-layer block spec (dense layers where the HF model has
them), Megatron's TopKRouter configured from the ArchSpec's router fields, and the routed experts as
`experts="grouped"` (learner.moe_experts: megatron's GroupedMLP layout computed by agentrl's grouped matmul,
agentrl.learners.megatron.grouped_experts; no Transformer Engine or grouped_gemm package needed) or
"sequential" (megatron's SequentialMLP: one MLP per expert, a Python loop of small matmuls). The token
dispatcher is the config's `moe_token_dispatcher_type` (learner.moe_token_dispatcher; default "allgather":
plain collectives, it runs on CPU over gloo as on GPU over NCCL; "alltoall" opens CUDA streams and is what
pipeline parallelism needs, whose variable sequence lengths megatron's allgather dispatcher refuses).
GLM's correction bias is the router's `expert_bias` buffer with an update rate of 0: it keeps the value the
engines route with (Megatron would otherwise move it toward balanced loads after every step).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from agentrl.errors import LearnerError
from agentrl.learners.megatron import cpu_compat
from agentrl.learners.megatron.arch import ArchSpec

__all__ = ["ArchSpec", "build_gpt", "layer_spec", "transformer_config", "unwrap"]


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def transformer_config(arch: ArchSpec, *, dtype: torch.dtype, device: str, fused: bool = False, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = device.startswith("cuda")
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not cuda,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        **{**moe_config(arch), **extra},  # extra wins: the pipeline's alltoall dispatcher
    )


def moe_config(arch: ArchSpec) -> dict:
    """TransformerConfig fields of a mixture of experts (none for a dense model)."""
    if not arch.num_experts:
        return {}
    return dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_layer_freq=[int(moe) for moe in arch.moe_layers],
        moe_router_topk=arch.moe_topk,
        moe_router_score_function=arch.router_score,
        moe_router_pre_softmax=arch.router_pre_softmax,
        moe_router_enable_expert_bias=arch.router_expert_bias,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=arch.router_groups or None,
        moe_router_group_topk=arch.router_group_topk or None,
        moe_router_topk_scaling_factor=arch.router_scaling if arch.router_scaling != 1.0 else None,
        # GLM's router runs in fp32 whatever the model's dtype (HF keeps gate.weight and the bias in fp32)
        moe_router_dtype="fp32" if arch.router_score == "sigmoid" else None,
        moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size or None,
        moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type="allgather",
    )


class SDPAttention(torch.nn.Module):
    """Core attention through torch scaled_dot_product_attention (causal, GQA), Megatron's tensor layout.

    Takes q [sq, b, np, hn], k/v [sk, b, ng, hn] (heads of this TP rank) and returns [sq, b, np*hn].
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):  # fmt: skip
        super().__init__()
        from megatron.core import parallel_state as ps

        self.config = config
        tp = ps.get_tensor_model_parallel_world_size() if pg_collection is None else pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is not None or attention_bias is not None:
            raise LearnerError("SDPAttention supports neither packed sequences nor attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.heads != self.groups:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout_p if self.training else 0.0, scale=self.scale
        )
        sq, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}


def _with_bias(linear: type) -> type:
    """`linear` (Megatron's or TE's row-parallel linear) built with a bias whatever `add_bias_linear` says."""

    class Biased(linear):
        def __init__(self, *args, bias: bool = False, **kwargs):
            super().__init__(*args, bias=True, **kwargs)

    Biased.__name__ = Biased.__qualname__ = f"Biased{linear.__name__}"
    return Biased


EXPERTS = ("grouped", "sequential")


def layer_spec(arch: ArchSpec, attention: str = "sdpa", use_te: bool | None = None, moe: bool = False,
               experts: str = "grouped"):  # fmt: skip
    """One transformer layer's spec; `moe`: its MLP is the mixture of experts, its routed experts `experts`
    ("grouped" or "sequential", module docstring)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if experts not in EXPERTS:
        raise LearnerError(f"learner.moe_experts = {experts!r}: choose one of {', '.join(EXPERTS)}")
    if use_te is None:
        use_te = have_transformer_engine()
    n_experts = arch.num_experts if moe else None
    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=n_experts, qk_layernorm=arch.qk_norm
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=n_experts, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
        )
        if attention == "sdpa":
            spec.submodules.self_attention.submodules.core_attention = SDPAttention
        elif attention != "local":
            raise LearnerError(f"attention {attention!r}: choose 'sdpa' or 'local'")
    if moe and experts == "grouped":  # with or without Transformer Engine: the converter knows this layout
        from megatron.core.transformer.spec_utils import ModuleSpec

        from agentrl.learners.megatron.grouped_experts import grouped_experts_class

        spec.submodules.mlp.submodules.experts = ModuleSpec(module=grouped_experts_class())
    if arch.proj_bias:
        attn = spec.submodules.self_attention.submodules
        attn.linear_proj = _with_bias(attn.linear_proj)
    return spec


def block_spec(arch: ArchSpec, config, attention: str = "sdpa", use_te: bool | None = None,
               experts: str = "grouped"):  # fmt: skip
    """The layer spec (dense) or this pipeline stage's block spec (MoE: dense and MoE layers as in HF)."""
    if not arch.num_experts:
        return layer_spec(arch, attention, use_te)
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
        get_transformer_layer_offset,
    )

    offset = get_transformer_layer_offset(config)
    local = arch.moe_layers[offset : offset + get_num_layers_to_build(config)]
    specs = {moe: layer_spec(arch, attention, use_te, moe=moe, experts=experts) for moe in set(local)}
    return TransformerBlockSubmodules(layer_specs=[specs[moe] for moe in local], layer_norm=LayerNormImpl)


def build_gpt(arch: ArchSpec, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
              attention: str = "sdpa", use_te: bool | None = None, fused: bool = False,
              experts: str = "grouped", **config_extra):  # fmt: skip
    """A GPTModel for this pipeline stage (parallel_state must be initialised), on `device`; a mixture of
    experts' routed experts `experts` ("grouped" or "sequential", module docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tp = ps.get_tensor_model_parallel_world_size()
    for name, value in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads),
                        ("vocab_size", arch.vocab_size)):  # fmt: skip
        if value % tp:
            raise LearnerError(f"{name} = {value} is not divisible by learner.tensor_parallel = {tp}")
    if arch.num_experts:
        _check_moe_layout(arch, tp)
        _without_te_gemm()
        config_extra.setdefault("expert_model_parallel_size", ps.get_expert_model_parallel_world_size())
    config_extra.setdefault("tensor_model_parallel_size", tp)
    config_extra.setdefault("pipeline_model_parallel_size", ps.get_pipeline_model_parallel_world_size())
    config = transformer_config(arch, dtype=dtype, device=device, fused=fused, **config_extra)
    building = contextlib.nullcontext() if device.startswith("cuda") else cpu_compat.building()
    with building:
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(arch, config, attention, use_te, experts),
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tied,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            rope_scaling=arch.llama3_rope_factor > 0,
            rope_scaling_factor=arch.llama3_rope_factor or 8.0,
            rotary_percent=arch.rotary_percent,
        )
    if not device.startswith("cuda"):
        cpu_compat.patch_model(model)
    if arch.router_expert_bias:
        _keep_expert_bias(model)
    return model.to(device)


def _no_expert_load_count(routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
    """Stands in for the router's count of tokens per expert, which feeds only the expert-bias update (rate 0
    here) and which megatron-core 0.16 cannot take with a padding_mask ([tokens] against [tokens, experts])."""


def _keep_expert_bias(model: torch.nn.Module) -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module._apply_expert_bias = _no_expert_load_count


def _without_te_gemm() -> None:
    """megatron-core 0.16's router gating tests `te_general_gemm is not None`, a name it defines only when
    Transformer Engine imports: without it, define it as None (its torch.mm fallback)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


MOE_MIN_MEGATRON = (0, 16)  # padding_mask in MoE layers, the router's replay hook, moe_router_dtype


def _check_moe_layout(arch: ArchSpec, tp: int) -> None:
    from megatron.core import package_info
    from megatron.core import parallel_state as ps

    version = tuple(int(part) for part in package_info.__version__.split(".")[:2])
    if version < MOE_MIN_MEGATRON:
        raise LearnerError(
            f"model_type {arch.model_type!r} (a mixture of experts) needs megatron-core >= "
            f"{'.'.join(map(str, MOE_MIN_MEGATRON))}, found {package_info.__version__}"
        )
    if tp > 1:  # Megatron's MoE layer needs sequence parallelism under TP, which the learner does not run
        raise LearnerError(
            f"learner.tensor_parallel = {tp} with a mixture-of-experts model: use learner.tensor_parallel = "
            "1 and spread the experts with learner.expert_parallel"
        )
    ep = ps.get_expert_model_parallel_world_size()
    if arch.num_experts % ep:
        raise LearnerError(
            f"num_experts = {arch.num_experts} is not divisible by learner.expert_parallel = {ep}"
        )


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
