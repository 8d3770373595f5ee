"""Hugging Face <-> Megatron-core weight conversion (Qwen2, Qwen3, Llama, Qwen3-MoE, GLM-4.5-MoE), exact
(views and concatenations only).

Layout (per transformer layer, HF names under `model.layers.{i}.`):
  linear_qkv  = per query group g: [q rows of the group's heads (heads_per_group*head_dim); k rows (head_dim);
                v rows (head_dim)], groups stacked; same for the bias (Qwen2, attention_bias). A TP rank holds a
                contiguous block of groups, so TP sharding is a plain chunk along dim 0.
  linear_fc1  = cat(gate_proj, up_proj); a TP rank holds cat(gate shard, up shard).
  linear_proj / linear_fc2 are row-parallel (split dim 1; linear_proj.bias = o_proj.bias, replicated);
  embedding / output_layer split the vocab (dim 0); norms (input, pre-MLP, q/k-norm, final) are replicated.
  Tied models have no output_layer (HF: no lm_head).
  MoE layers (HF `mlp.gate`, `mlp.experts.{e}.*`, GLM's `mlp.shared_experts.*`): the router weight and GLM's
  `e_score_correction_bias` (Megatron: the router's `expert_bias` buffer) are replicated; expert e's
  gate/up/down become `mlp.experts.local_experts.{e}.linear_fc1` (GLU) / `linear_fc2`, the shared expert
  `mlp.shared_experts.linear_fc1` / `linear_fc2`; the pre-MLP norm is never fused into a MoE layer.
  Global names number experts globally: expert-parallel rank r holds experts r*n .. r*n+n-1 (n = experts / EP)
  as its local_experts 0..n-1. Grouped experts (megatron's GroupedMLP layout: weight1 / weight2 over the local
  experts, agentrl.learners.megatron.grouped_experts) go by the same per-expert names, as views.
`load_hf` refuses an HF checkpoint holding a tensor no group maps (nothing is dropped silently).

A `Group` maps one Megatron parameter (global layer numbering: `decoder.layers.{i}.`) to its HF tensors.
Checkpoints store Megatron shards under these global names, so `to_hf` works offline from files alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import torch

from agentrl.errors import LearnerError
from agentrl.learners.megatron.arch import ArchSpec
from agentrl.learners.megatron.grouped_experts import expert_views, is_grouped

REPLICATED, ROW, COL, QKV, GLU = "replicated", "dim0", "dim1", "qkv", "glu"


@dataclasses.dataclass(frozen=True)
class Group:
    mcore: str  # global Megatron name
    hf: tuple[str, ...]
    kind: str
    layer: int | None = None  # global layer index, None for embedding / final norm / output layer
    expert: int | None = None  # global expert index of a routed expert's weights


def groups(arch: ArchSpec, te: bool = False) -> list[Group]:
    """All parameter groups in HF order. `te`: Transformer Engine names (norms fused into the linears)."""
    out = [Group("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), ROW)]
    in_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
    for i in range(arch.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = h + "self_attn."
        qkv = (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")
        layer = [Group(m + in_norm, (h + "input_layernorm.weight",), REPLICATED, i)]
        layer.append(Group(m + "self_attention.linear_qkv.weight", qkv, QKV, i))
        if arch.qkv_bias:
            bias = tuple(n.replace(".weight", ".bias") for n in qkv)
            layer.append(Group(m + "self_attention.linear_qkv.bias", bias, QKV, i))
        if arch.qk_norm:
            layer.append(
                Group(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), REPLICATED, i)
            )
            layer.append(
                Group(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), REPLICATED, i)
            )
        layer.append(Group(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), COL, i))
        if arch.proj_bias:  # added after the row-parallel all-reduce: one full copy per TP rank
            layer.append(Group(m + "self_attention.linear_proj.bias", (attn + "o_proj.bias",), REPLICATED, i))
        moe = bool(arch.moe_layers) and arch.moe_layers[i]
        norm = m + ("pre_mlp_layernorm.weight" if moe else mlp_norm)
        layer.append(Group(norm, (h + "post_attention_layernorm.weight",), REPLICATED, i))
        layer.extend(_moe_groups(arch, i) if moe else _mlp_groups(m + "mlp.", h + "mlp.", i))
        out.extend(layer)
    out.append(Group("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
    if not arch.tied:
        out.append(Group("output_layer.weight", ("lm_head.weight",), ROW))
    return out


def _mlp_groups(m: str, h: str, layer: int, expert: int | None = None) -> list[Group]:
    """A SwiGLU MLP: Megatron prefix `m`, HF prefix `h` (both ending in '.')."""
    glu = (h + "gate_proj.weight", h + "up_proj.weight")
    return [
        Group(m + "linear_fc1.weight", glu, GLU, layer, expert),
        Group(m + "linear_fc2.weight", (h + "down_proj.weight",), COL, layer, expert),
    ]


def _moe_groups(arch: ArchSpec, i: int) -> list[Group]:
    m, h = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    out = [Group(m + "router.weight", (h + "gate.weight",), REPLICATED, i)]
    if arch.router_expert_bias:
        out.append(Group(m + "router.expert_bias", (h + "gate.e_score_correction_bias",), REPLICATED, i))
    for e in range(arch.num_experts):
        out.extend(_mlp_groups(f"{m}experts.local_experts.{e}.", f"{h}experts.{e}.", i, e))
    if arch.shared_expert_intermediate_size:
        out.extend(_mlp_groups(m + "shared_experts.", h + "shared_experts.", i))
    return out


def _mlp_shapes(h: str, hidden: int, ffn: int) -> dict[str, tuple[int, ...]]:
    return {h + "gate_proj.weight": (ffn, hidden), h + "up_proj.weight": (ffn, hidden),
            h + "down_proj.weight": (hidden, ffn)}  # fmt: skip


def hf_shapes(arch: ArchSpec) -> dict[str, tuple[int, ...]]:
    h, hd, ffn = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h)}
        shapes |= {p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        if arch.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)}
            shapes |= {p + "self_attn.v_proj.bias": (kv,)}
        if arch.proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if arch.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if not (arch.moe_layers and arch.moe_layers[i]):
            shapes |= _mlp_shapes(p + "mlp.", h, ffn)
            continue
        shapes[p + "mlp.gate.weight"] = (arch.num_experts, h)
        if arch.router_expert_bias:
            shapes[p + "mlp.gate.e_score_correction_bias"] = (arch.num_experts,)
        for e in range(arch.num_experts):
            shapes |= _mlp_shapes(f"{p}mlp.experts.{e}.", h, arch.moe_intermediate_size)
        if arch.shared_expert_intermediate_size:
            shapes |= _mlp_shapes(p + "mlp.shared_experts.", h, arch.shared_expert_intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not arch.tied:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ArchSpec) -> torch.Tensor:
    ng, hd = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    parts = (
        q.reshape(ng, arch.heads_per_group * hd, *rest),
        k.reshape(ng, hd, *rest),
        v.reshape(ng, hd, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def unpack_qkv(qkv: torch.Tensor, arch: ArchSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hd = arch.num_kv_heads, arch.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (arch.heads_per_group + 2) * hd, *rest)
    q, k, v = torch.split(grouped, [arch.heads_per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def shard(
    group: Group, hf: list[torch.Tensor], arch: ArchSpec, tp_rank: int = 0, tp_size: int = 1
) -> torch.Tensor:
    """The Megatron tensor of TP rank `tp_rank` for this group, from full HF tensors."""
    if group.kind == REPLICATED:
        return hf[0]
    if group.kind == ROW:
        return hf[0].chunk(tp_size, dim=0)[tp_rank]
    if group.kind == COL:
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if group.kind == QKV:
        return pack_qkv(*hf, arch).chunk(tp_size, dim=0)[tp_rank]
    if group.kind == GLU:
        return torch.cat([t.chunk(tp_size, dim=0)[tp_rank] for t in hf], dim=0)
    raise LearnerError(f"unknown group kind {group.kind!r}")


def unshard(group: Group, shards: list[torch.Tensor], arch: ArchSpec) -> list[torch.Tensor]:
    """Full HF tensors (in `group.hf` order) from the TP shards of rank 0..tp-1."""
    if group.kind == REPLICATED:
        return [shards[0]]
    if group.kind == ROW:
        return [torch.cat(shards, dim=0)]
    if group.kind == COL:
        return [torch.cat(shards, dim=1)]
    if group.kind == QKV:
        return list(unpack_qkv(torch.cat(shards, dim=0), arch))
    if group.kind == GLU:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise LearnerError(f"unknown group kind {group.kind!r}")


_LOCAL_EXPERTS = "mlp.experts.local_experts."


def local_to_global(model: torch.nn.Module) -> Callable[[str], str]:
    """Map this stage's parameter names (local layer index, local expert index) to global numbering."""
    layers = model.decoder.layers
    offsets = {str(j): str(layer.layer_number - 1) for j, layer in enumerate(layers)}
    first_expert = {str(j): layer.mlp.local_expert_indices[0] for j, layer in enumerate(layers)
                    if hasattr(layer.mlp, "local_expert_indices")}  # fmt: skip

    def convert(name: str) -> str:
        if name.startswith("decoder.layers."):
            j, rest = name[len("decoder.layers.") :].split(".", 1)
            if rest.startswith(_LOCAL_EXPERTS):
                e, tail = rest[len(_LOCAL_EXPERTS) :].split(".", 1)
                rest = f"{_LOCAL_EXPERTS}{first_expert[j] + int(e)}.{tail}"
            return f"decoder.layers.{offsets[j]}.{rest}"
        return name

    return convert


def is_te_model(model: torch.nn.Module) -> bool:
    return any("layer_norm_weight" in n for n, _ in model.named_parameters())


def global_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{global name: tensor} of this rank's parameters and the routers' `expert_bias` buffers (weights of the
    model the optimizer does not step: GLM's correction bias). Grouped experts (weight1 / weight2) appear as
    per-expert views under SequentialMLP's names: the same names and tensors in either layout, and writing a
    view writes the grouped weight."""
    to_global = local_to_global(model)
    grouped = {n + ".": m for n, m in model.named_modules() if n.endswith("mlp.experts") and is_grouped(m)}
    out: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        if n.rpartition(".")[0] + "." not in grouped:
            out[to_global(n)] = p
    for prefix, module in grouped.items():  # GroupedMLP's weight1 / weight2 as per-expert views
        out |= {to_global(n): v for n, v in expert_views(prefix, module).items()}
    out |= {to_global(n): b for n, b in model.named_buffers() if n.endswith("router.expert_bias")}
    return out


def check_hf_names(arch: ArchSpec, hf_names: Iterable[str]) -> None:
    """LearnerError naming the HF tensors that no group maps (a tied model may also store lm_head.weight;
    rotary inv_freq buffers of old checkpoints are recomputed)."""
    mapped = {name for group in groups(arch) for name in group.hf} | {"lm_head.weight"}
    extra = sorted(n for n in hf_names if n not in mapped and not n.endswith("rotary_emb.inv_freq")
                   and not _beyond_last_layer(arch, n))  # fmt: skip
    if extra:
        raise LearnerError(
            f"the HF checkpoint has {len(extra)} tensors the Megatron converter does not map, e.g. {extra[:4]}"
        )


def _beyond_last_layer(arch: ArchSpec, name: str) -> bool:
    """GLM-4.5's multi-token-prediction layers, numbered after the last decoder layer: transformers skips them
    (they only draft tokens for speculative decoding)."""
    if arch.model_type != "glm4_moe" or not name.startswith("model.layers."):
        return False
    return int(name.split(".")[2]) >= arch.num_layers


@torch.no_grad()
def load_hf(model: torch.nn.Module, arch: ArchSpec, get_hf: Callable[[str], torch.Tensor],
            tp_rank: int = 0, tp_size: int = 1) -> None:  # fmt: skip
    """Copy HF weights (fetched one name at a time by `get_hf`) into this rank's Megatron parameters."""
    params = global_params(model)
    seen = set()
    for group in groups(arch, te=is_te_model(model)):
        param = params.get(group.mcore)
        if param is None:
            continue
        value = shard(group, [get_hf(n) for n in group.hf], arch, tp_rank, tp_size)
        if value.shape != param.shape:
            raise LearnerError(
                f"{group.mcore}: HF gives shape {tuple(value.shape)}, model has {tuple(param.shape)}"
            )
        param.copy_(value)
        seen.add(group.mcore)
    if arch.tied and "output_layer.weight" in params:
        emb = params.get("embedding.word_embeddings.weight")
        params["output_layer.weight"].copy_(shard(groups(arch)[0], [get_hf("model.embed_tokens.weight")], arch,
                                                  tp_rank, tp_size) if emb is None else emb)  # fmt: skip
        seen.add("output_layer.weight")
    missing = sorted(set(params) - seen)
    if missing:
        raise LearnerError(f"no HF weights map to Megatron parameters {missing[:4]}")


def iter_hf(model: torch.nn.Module, arch: ArchSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(hf_name, tensor)` for the whole model. Collective under TP/PP: every rank must iterate."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    params = global_params(model)
    tp_size = ps.get_tensor_model_parallel_world_size()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    ep_size = ps.get_expert_model_parallel_world_size() if arch.num_experts else 1
    owners = _owners(params, pp_size)
    shapes = hf_shapes(arch)
    like = next(iter(params.values()))

    def empty(group: Group) -> list[torch.Tensor]:
        dtype = params[group.mcore].dtype if group.mcore in params else like.dtype
        if group.mcore.endswith("router.expert_bias"):  # Megatron keeps it in fp32 in any model dtype
            dtype = torch.float32
        return [torch.empty(shapes[n], dtype=dtype, device=like.device) for n in group.hf]

    for group in groups(arch, te=is_te_model(model)):
        tensors: list[torch.Tensor] | None = None
        if group.mcore in params:
            local = params[group.mcore].detach()
            shards = [local]
            if tp_size > 1 and group.kind != REPLICATED:
                shards = [torch.empty_like(local) for _ in range(tp_size)]
                dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            tensors = unshard(group, shards, arch)
        if group.expert is not None and ep_size > 1:  # from the expert-parallel rank that holds it
            src = ps.get_expert_model_parallel_group()
            owner = group.expert // (arch.num_experts // ep_size)
            tensors = tensors if tensors is not None else empty(group)
            for t in tensors:
                dist.broadcast(t.contiguous(), src=dist.get_global_rank(src, owner), group=src)
        if pp_size > 1:
            src = ps.get_pipeline_model_parallel_group()
            # another stage's expert may be held by another EP rank: its layer's router says which stage
            owner = owners.get(group.mcore, owners.get(f"decoder.layers.{group.layer}.mlp.router.weight"))
            tensors = tensors if tensors is not None else empty(group)
            for t in tensors:
                dist.broadcast(t.contiguous(), src=dist.get_global_rank(src, owner), group=src)
        # grouped experts' views are transposed: the publish paths and safetensors want row-major tensors
        yield from zip(group.hf, (t if t.is_contiguous() else t.contiguous() for t in tensors), strict=True)


def _owners(params: dict[str, torch.Tensor], pp_size: int) -> dict[str, int]:
    """Which pipeline rank holds each global Megatron name (all-gathered once per `iter_hf`)."""
    if pp_size == 1:
        return dict.fromkeys(params, 0)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    everyone: list[list[str] | None] = [None] * pp_size
    dist.all_gather_object(everyone, sorted(params), group=ps.get_pipeline_model_parallel_group())
    owners: dict[str, int] = {}
    for rank, names in enumerate(everyone):
        for name in names or []:
            if name == "output_layer.weight" and "output_layer.weight" in owners:
                continue
            owners.setdefault(name, rank)
    return owners
