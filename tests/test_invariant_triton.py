"""agentrl.invariant_triton's kernels on CPU through Triton's interpreter: each computes its op (values against
torch within rounding) and a row's result does not depend on the other rows of the call, its place among them,
or, for attention, on being a prefill row or a decode row over a cache slot with a stale tail
(tests/invariant_triton_checks.py, in a process of its own: Triton reads TRITON_INTERPRET when imported); and
(slow) the engine and the learner end to end through them.
Skipped without triton; on a CUDA machine tests/test_true_on_policy_gpu.py runs the compiled kernels instead."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers CUDA machines")

ROOT = Path(__file__).resolve().parent.parent


def _run(*checks: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "tests.invariant_triton_checks", *checks], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")] == list(checks)


def test_kernels_in_the_interpreter():
    _run(
        "test_matmul_and_rms_norm_rows_do_not_depend_on_the_call",
        "test_matmul_tile_follows_the_weight_shape",
        "test_fused_elementwise_kernels",
        "test_norm_and_silu_backward",
        "test_qk_norm_rope_backward",
        "test_token_logprobs_backward",
        "test_token_logprobs",
        "test_attention_prefill_equals_decode_over_a_stale_slot",
    )


@pytest.mark.slow
def test_engine_equals_learner_through_the_interpreted_kernels():
    """The GPU path end to end on CPU: engine (prefill, continuous-batch decode) and learner (padded, packed,
    training forward with its backward) through the interpreted kernels, bit for bit (a minute of CPU)."""
    _run("test_engine_equals_learner_through_the_kernels")
