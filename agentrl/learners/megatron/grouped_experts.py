"""A mixture of experts' routed experts as grouped matmuls, without Transformer Engine or the grouped_gemm
package: megatron-core's `GroupedMLP` with agentrl's own `gmm`.

Layout (megatron-core's GroupedMLP, kept so its distributed-checkpoint and DDP attributes stay right): a layer's
local experts live in two parameters, `weight1` [hidden, local_experts * 2 * ffn] and `weight2`
[local_experts * ffn, hidden]; `weight1.view(local_experts, hidden, 2 * ffn)[e]` is local expert e's
`linear_fc1.weight` transposed (gate rows then up rows, as SequentialMLP's), `weight2.view(local_experts, ffn,
hidden)[e]` its `linear_fc2.weight` transposed. `expert_views(module)` gives those per-expert views under
SequentialMLP's names, so the HF converter, the checkpoints and the publish see the same per-expert tensors
whichever layout runs (agentrl.learners.megatron.convert).

`gmm(x, w, tokens_per_expert)` multiplies each expert's contiguous block of rows of `x` (tokens sorted by expert,
as megatron's token dispatchers hand them over) by that expert's `w[e]`: `torch.nn.functional.grouped_mm`
(one kernel for all experts; bf16 on Hopper GPUs, fp32 and bf16 on the CPU), with torch's own autograd; where
that kernel cannot take the operands (fp32 on a GPU, rows not 16-byte aligned, non-bf16 under torch.compile)
a matmul per expert computes the same.

Why a subclass and not megatron's GroupedMLP as is: GroupedMLP asserts bf16 (the CPU tests run fp32) and calls
`grouped_gemm.ops.gmm` from a package that needs CUDA to build; the subclass keeps GroupedMLP's parameters and
initialisation and replaces only the forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from agentrl.errors import LearnerError

# megatron-core's GroupedMLP names, and SequentialMLP's per-expert names the converter uses for both layouts
WEIGHT1, WEIGHT2 = "weight1", "weight2"
FC1, FC2 = "linear_fc1.weight", "linear_fc2.weight"


# whether this GPU has grouped_mm kernels (Hopper sm90, Blackwell sm100): read once when the first grouped
# experts are built, outside any compiled region (a plain global is a constant to torch.compile, a device
# query may not be)
_CUDA_GROUPED_MM = False
# torch.nn.functional.grouped_mm (what the embedded engine calls), else the private op of older torch
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether grouped_mm runs these operands (else the per-expert matmuls)."""
    if _GROUPED_MM is None or x.dtype != w.dtype:
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or not _CUDA_GROUPED_MM:
            return False
    elif x.dtype not in (torch.float32, torch.bfloat16):
        return False
    elif x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # torch.compile's shape functions for grouped_mm take bf16 alone
    # row strides must be multiples of 16 bytes (the kernels' TMA / vector loads)
    return (x.shape[-1] * x.element_size()) % 16 == 0 and (w.shape[-1] * w.element_size()) % 16 == 0


def gmm(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, trans_b: bool = False
) -> torch.Tensor:
    """[sum(tokens_per_expert), k] x [experts, k, n] -> [sum(tokens_per_expert), n], rows of expert e times
    w[e] (`trans_b`: w is [experts, n, k]). The signature of grouped_gemm.ops.gmm."""
    if trans_b:
        w = w.transpose(1, 2)
    if _grouped_mm_takes(x, w):
        ends = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int32), 0, dtype=torch.int32)
        return _GROUPED_MM(x, w, offs=ends)
    sizes = tokens_per_expert.tolist()
    return torch.cat([rows @ w[e] for e, rows in enumerate(torch.split(x, sizes))])


# what megatron's grouped_gemm_util reads from the grouped_gemm package: `grouped_gemm.ops.gmm`
_PACKAGE = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=gmm))


def install_ops() -> None:
    """Make megatron-core's grouped_gemm_util use `gmm` where the grouped_gemm package is not installed (its
    GroupedMLP asserts the package is there; `GroupedExperts` subclasses it)."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if gg.grouped_gemm is None:
        gg.grouped_gemm, gg.ops = _PACKAGE, _PACKAGE.ops


def grouped_experts_class() -> type:
    """`GroupedExperts` (built on first use: megatron-core is imported only by the learner)."""
    global _GROUPED
    if _GROUPED is None:
        _GROUPED = _build_class()
    return _GROUPED


_GROUPED: type | None = None


def _build_class() -> type:
    from megatron.core.transformer.moe.experts import GroupedMLP

    global _CUDA_GROUPED_MM
    _CUDA_GROUPED_MM = torch.cuda.is_available() and torch.cuda.get_device_capability() in ((9, 0), (10, 0))
    install_ops()

    class GroupedExperts(GroupedMLP):
        """megatron-core's GroupedMLP (parameters, initialisation, sharded state) with `gmm` in any dtype."""

        def __init__(self, num_local_experts, config, pg_collection=None):
            if config.activation_func is not F.silu or not config.gated_linear_unit:
                raise LearnerError(
                    "learner.moe_experts = 'grouped' computes SwiGLU experts only; use 'sequential'"
                )
            super().__init__(num_local_experts, config, pg_collection=pg_collection)

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            x, e = permuted_local_hidden_states, self.num_local_experts
            h = self.config.hidden_size
            if x.shape[0] == 0:
                # no token for these experts: the weights AND the probs still join the graph, so that this
                # rank's backward runs the dispatcher's collectives for them as the other EP ranks' do
                gate, up = (x @ self.weight1.view(h, -1)).chunk(2, dim=-1)
                return self._act(gate, up, permuted_probs, x.dtype) @ self.weight2, None
            w1, w2 = self.weight1.view(e, h, -1), self.weight2.view(e, -1, h)
            gate, up = gmm(x, w1, tokens_per_expert).chunk(2, dim=-1)
            return gmm(self._act(gate, up, permuted_probs, x.dtype), w2, tokens_per_expert), None

        @staticmethod
        def _act(gate, up, probs, dtype):
            # as megatron's MLP with per-token probs: act(fc1) * probs in the probs' dtype, then the model's
            return (F.silu(gate) * up * probs.unsqueeze(-1)).to(dtype)

    return GroupedExperts


def is_grouped(module: torch.nn.Module) -> bool:
    """Whether `module` holds its experts in GroupedMLP's layout (weight1 / weight2)."""
    return all(hasattr(module, n) for n in (WEIGHT1, WEIGHT2, "num_local_experts"))


def expert_views(prefix: str, module: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """{`prefix`local_experts.{e}.linear_fc1.weight / linear_fc2.weight: view} of a grouped experts module:
    views of its weight1 / weight2 (`grads`: of their gradients) shaped as SequentialMLP's parameters (writing a
    view writes the weights)."""
    e, h = module.num_local_experts, module.config.hidden_size
    w1, w2 = (module.weight1.grad, module.weight2.grad) if grads else (module.weight1, module.weight2)
    w1, w2 = w1.view(e, h, -1), w2.view(e, -1, h)
    out = {}
    for i in range(e):
        out[f"{prefix}local_experts.{i}.{FC1}"] = w1[i].t()
        out[f"{prefix}local_experts.{i}.{FC2}"] = w2[i].t()
    return out
