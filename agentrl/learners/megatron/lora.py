"""LoRA on Megatron's tensor-parallel linears, named and laid out as peft's adapter of the Hugging Face model.

Each HF target (`q_proj`, ..., `down_proj`) gets its own A [r, in] and B [out, r], exactly as peft gives each HF
module its own pair, and its update is placed where that module's rows live in the fused Megatron linear:
  linear_qkv (column-parallel): per query group [q rows; k rows; v rows] (convert.py's layout); a TP rank holds
      whole groups, so its share of B_q / B_k / B_v is a contiguous chunk of the HF rows (dim 0). A is
      replicated; its output passes `copy_to_tensor_model_parallel_region`, so each rank's gradient of A sums
      every rank's B rows (all-reduced in the backward).
  linear_fc1 (column-parallel) = [gate rows; up rows] of this rank: B_gate / B_up chunked along dim 0.
  linear_proj / linear_fc2 (row-parallel): the input is sharded, so A is chunked along dim 1 and A·x is
      summed over TP ranks (`reduce_from_tensor_model_parallel_region`) before the replicated B.
Untargeted parts of a fused linear get no update (zeros), like an HF module peft does not wrap. The update is
added by a forward hook on the linear, so the base parameters keep their names (convert.py, checkpoints) and
`disabled(model)` turns every adapter off for the reference pass (KL against the base: no second copy).
Initialisation is peft's (A ~ kaiming-uniform(a=sqrt(5)) of the full [r, in] matrix from a generator seeded per
layer and target, B = 0), so the adapter starts the same at every TP size. The adapter needs the normed input
of linear_qkv / linear_fc1, which Transformer Engine's fused layernorm-linear does not expose: a LoRA learner
builds the local layer spec. Names out (`gather`) are peft's: `model.layers.{i}.self_attn.q_proj.lora_A.weight`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from agentrl.config.learning import LoraSection
from agentrl.errors import LearnerError
from agentrl.learners.megatron.arch import ArchSpec

# HF target -> (Megatron linear under decoder.layers.{i}., part of its output, HF module under model.layers.{i}.)
TARGETS = {
    "q_proj": ("self_attention.linear_qkv", "q", "self_attn.q_proj"),
    "k_proj": ("self_attention.linear_qkv", "k", "self_attn.k_proj"),
    "v_proj": ("self_attention.linear_qkv", "v", "self_attn.v_proj"),
    "o_proj": ("self_attention.linear_proj", "", "self_attn.o_proj"),
    "gate_proj": ("mlp.linear_fc1", "gate", "mlp.gate_proj"),
    "up_proj": ("mlp.linear_fc1", "up", "mlp.up_proj"),
    "down_proj": ("mlp.linear_fc2", "", "mlp.down_proj"),
}
ROW_PARALLEL = {"self_attention.linear_proj", "mlp.linear_fc2"}
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def targets(lora: LoraSection) -> list[str]:
    """The HF target names, `all-linear` expanded; an unknown name is an error naming the setting."""
    names = list(TARGETS) if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise LearnerError(
            f"learner.lora.target_modules = {lora.target_modules}: the Megatron learner adapts "
            f"{sorted(TARGETS)} or 'all-linear', not {unknown}"
        )
    return [n for n in TARGETS if n in names]  # Megatron output order (q, k, v; gate, up)


def hf_shape(arch: ArchSpec, target: str) -> tuple[int, int]:
    """(out, in) of the HF module."""
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    ffn = arch.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (ffn, h),
            "up_proj": (ffn, h), "down_proj": (h, ffn)}[target]  # fmt: skip


class Adapter(torch.nn.Module):
    """The LoRA pairs of one Megatron linear (one per targeted HF module); `forward(x)` is the update."""

    def __init__(self, linear: str, arch: ArchSpec, lora: LoraSection, parts: list[str], layer: int,
                 tp_rank: int, tp_size: int, dtype: torch.dtype, device: torch.device, seed: int):  # fmt: skip
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        self.row = linear in ROW_PARALLEL
        self.parts, self.arch, self.tp_size = parts, arch, tp_size
        self.scale = lora.alpha / lora.rank
        self.enabled = True
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for target in parts:
            out, inp = hf_shape(arch, target)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 97 + list(TARGETS).index(target))
            bound = 1.0 / math.sqrt(inp)  # kaiming_uniform_(a=sqrt(5)) of [r, in], as peft initialises A
            a = torch.rand(lora.rank, inp, generator=gen, dtype=torch.float32) * (2 * bound) - bound
            a = a.chunk(tp_size, dim=1)[tp_rank] if self.row else a
            b = torch.zeros(out // (1 if self.row else tp_size), lora.rank)
            self.lora_A[target] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.lora_B[target] = torch.nn.Parameter(b.to(device=device, dtype=dtype))
            sharded, dim = (self.lora_A[target], 1) if self.row else (self.lora_B[target], 0)
            set_tensor_model_parallel_attributes(sharded, True, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as mtp

        x = self.dropout(x)
        a = (
            torch.cat([self.lora_A[t] for t in self.parts])
            if len(self.parts) > 1
            else self.lora_A[self.parts[0]]
        )
        h = torch.nn.functional.linear(x.to(a.dtype), a)
        if self.tp_size > 1:
            h = mtp.reduce_from_tensor_model_parallel_region(h) if self.row else (
                mtp.copy_to_tensor_model_parallel_region(h))  # fmt: skip
        r = self.lora_A[self.parts[0]].shape[0]
        ups = {t: torch.nn.functional.linear(h[..., i * r : (i + 1) * r], self.lora_B[t]) * self.scale
               for i, t in enumerate(self.parts)}  # fmt: skip
        return self._place(ups, h.shape[:-1])

    def _place(self, ups: dict[str, torch.Tensor], lead: torch.Size) -> torch.Tensor:
        """Each target's update at its rows of the fused output (zeros for the fused parts not targeted)."""
        if self.row:
            return ups[self.parts[0]]
        sample = next(iter(ups.values()))

        def part(target: str) -> torch.Tensor:
            if target in ups:
                return ups[target]
            return sample.new_zeros(*lead, hf_shape(self.arch, target)[0] // self.tp_size)

        if self.parts[0] in ("gate_proj", "up_proj"):
            return torch.cat([part("gate_proj"), part("up_proj")], dim=-1)
        groups = self.arch.num_kv_heads // self.tp_size
        q, k, v = (part(t).reshape(*lead, groups, -1) for t in ("q_proj", "k_proj", "v_proj"))
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)


def _hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    adapter = module.lora
    if not adapter.enabled:
        return output
    out, bias = output
    x = args[0] if args else kwargs["input_"]
    return out + adapter(x).to(out.dtype), bias


def attach(model: torch.nn.Module, arch: ArchSpec, lora: LoraSection, tp_rank: int, tp_size: int,
           seed: int) -> None:  # fmt: skip
    """Freeze every base parameter and give each targeted linear of this stage an `Adapter` (as `.lora`)."""
    names = targets(lora)
    model.requires_grad_(False)
    weight = next(model.parameters())
    for layer in model.decoder.layers:
        index = layer.layer_number - 1  # global layer index (this stage's layers under PP)
        by_linear: dict[str, list[str]] = {}
        for target in names:
            by_linear.setdefault(TARGETS[target][0], []).append(target)
        for linear_name, parts in by_linear.items():
            linear = layer.get_submodule(linear_name)
            linear.lora = Adapter(linear_name, arch, lora, parts, index, tp_rank, tp_size, weight.dtype,
                                  weight.device, seed)  # fmt: skip
            linear.register_forward_hook(_hook, with_kwargs=True)


def adapters(model: torch.nn.Module) -> Iterator[tuple[int, Adapter]]:
    """(global layer index, adapter) for every adapter of this stage."""
    for layer in model.decoder.layers:
        for module in layer.modules():
            if isinstance(module, Adapter):
                yield layer.layer_number - 1, module


@contextlib.contextmanager
def disabled(model: torch.nn.Module):
    """The base model: every adapter off (the reference model for KL)."""
    found = [a for _, a in adapters(model)]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True


def hf_module(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{TARGETS[target][2]}"


def _tp_gather(local: torch.Tensor, dim: int) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    shards = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=dim)


@torch.no_grad()
def gather(model: torch.nn.Module, *, scaled: bool) -> dict[str, torch.Tensor]:
    """The whole adapter under peft's HF names, A then B of each module in layer order; B times alpha / r when
    `scaled` (what a publish sends), else as peft stores it. Collective: every TP and PP rank must call it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    out: dict[str, torch.Tensor] = {}
    for layer, adapter in adapters(model):
        for target in adapter.parts:
            a, b = adapter.lora_A[target].detach(), adapter.lora_B[target].detach()
            if tp > 1:
                a, b = (_tp_gather(a, 1), b) if adapter.row else (a, _tp_gather(b, 0))
            name = hf_module(layer, target)
            out[name + A_SUFFIX] = a
            out[name + B_SUFFIX] = (b.float() * adapter.scale).to(b.dtype) if scaled else b
    if pp > 1:  # each stage holds its own layers: MBs, so an object all-gather is enough
        stages: list = [None] * pp
        mine = {k: v.cpu() for k, v in out.items()}
        dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
        out = {k: v for stage in stages for k, v in stage.items()}
    return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def _order(name: str) -> tuple[int, int, int]:
    layer = int(name.split(".")[2])
    target = next(i for i, (_, _, hf) in enumerate(TARGETS.values()) if f".{hf}." in name)
    return layer, target, int(name.endswith(B_SUFFIX))


@torch.no_grad()
def load(model: torch.nn.Module, state: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> None:
    """Copy a full HF-named adapter (peft's unscaled B) into this rank's shards; every adapter must be there."""
    for layer, adapter in adapters(model):
        for target in adapter.parts:
            name = hf_module(layer, target)
            if name + A_SUFFIX not in state or name + B_SUFFIX not in state:
                raise LearnerError(
                    f"the adapter has no {name}{A_SUFFIX} / {B_SUFFIX} (learner.lora differs?)"
                )
            a, b = state[name + A_SUFFIX], state[name + B_SUFFIX]
            a, b = (a.chunk(tp_size, 1)[tp_rank], b) if adapter.row else (a, b.chunk(tp_size, 0)[tp_rank])
            for param, value in ((adapter.lora_A[target], a), (adapter.lora_B[target], b)):
                if param.shape != value.shape:
                    raise LearnerError(
                        f"{name}: adapter shape {tuple(value.shape)}, model has {tuple(param.shape)}"
                    )
                param.copy_(value)


def merged(weights: Iterator[tuple[str, torch.Tensor]], adapter: dict[str, torch.Tensor]):
    """HF weights with each adapted module's W0 + B·A (`adapter` scaled, as `gather(scaled=True)` gives)."""
    for name, tensor in weights:
        module = name.removesuffix(".weight")
        if module + A_SUFFIX in adapter:
            a, b = adapter[module + A_SUFFIX], adapter[module + B_SUFFIX]
            tensor = (tensor.float() + b.float() @ a.float()).to(tensor.dtype)
        yield name, tensor
