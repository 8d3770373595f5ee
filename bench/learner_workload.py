"""The learner benches' workload: model dims (Qwen3-0.6B / 1.7B, tiny, the MoE architectures of
bench/engine_bench.py), the random-init model directory every rank reads, and the batch a step trains on.
Used by bench/megatron_bench.py, bench/checkpoint_stall.py and bench/gpu/fsdp_check.py, so that their numbers
are of the same model and batch."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # engine_bench, also when imported as bench.learner_workload

import torch
from engine_bench import MOE_ARCHS, build_model  # the one builder of random MoE models

QWEN3_06B = dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936)
QWEN3_17B = dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=6144, vocab=151936)
MODELS = {"qwen3-0.6b": QWEN3_06B, "qwen3-1.7b": QWEN3_17B}
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=512)
# --tiny with an MoE --model: its family in small (4 experts, top-2), for the CPU smoke test
TINY_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, moe_intermediate_size=32, vocab_size=512, num_experts=4,
                num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2)  # fmt: skip


def fill_defaults(args, steps: tuple[int, int]):
    """The workload's defaults filled into parsed `args` (dims, batch, sequence length, dtype, model
    directory); `steps` = (tiny, full) timed steps."""
    model = getattr(args, "model", "qwen3-0.6b")
    args.moe_overrides = {}
    if model in MOE_ARCHS:
        args.moe_overrides = {k: v for k, v in TINY_MOE.items() if k in MOE_ARCHS[model]} if args.tiny else {}
        args.dims = moe_dims({**MOE_ARCHS[model], **args.moe_overrides})
    else:
        args.dims = TINY if args.tiny else MODELS[model]
    args.batch = args.batch or (4 if args.tiny else 8)
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.steps = args.steps or (steps[0] if args.tiny else steps[1])
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    name = f"tiny-{model}" if args.tiny and model in MOE_ARCHS else "tiny" if args.tiny else model
    args.model_dir = args.model_dir or f"/tmp/agentrl-bench-{name}-{args.dtype}"
    return args


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


def hf_config(dims: dict):
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=dims["hidden"], num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"], intermediate_size=dims["ffn"],
        vocab_size=dims["vocab"], tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip


def moe_dims(spec: dict) -> dict:
    """The dims this script counts FLOPs with, from a `MOE_ARCHS` config (Qwen3-MoE or GLM-4.5 MoE)."""
    layers = spec["num_hidden_layers"]
    dense = spec.get("first_k_dense_replace", 0) + len(spec.get("mlp_only_layers", []))
    return dict(hidden=spec["hidden_size"], layers=layers, heads=spec["num_attention_heads"],
                kv_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"], ffn=spec["intermediate_size"],
                vocab=spec["vocab_size"], experts=spec.get("num_experts") or spec["n_routed_experts"],
                topk=spec["num_experts_per_tok"], moe_ffn=spec["moe_intermediate_size"],
                shared=spec.get("n_shared_experts", 0), dense_layers=min(dense, layers))  # fmt: skip


def ensure_model_dir(args) -> Path:
    """Rank 0 writes a random-init HF directory once; everyone else waits on the process group."""
    import torch.distributed as dist

    path = Path(args.model_dir)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0 and "experts" in args.dims and not (path / "config.json").exists():  # saved in shards when large
        t0 = time.perf_counter()
        built = build_model(args.model, path.parent / f"{path.name}.build", args.dtype, args.device,
                            args.moe_overrides)  # fmt: skip
        built.rename(path)
        log(f"wrote random model to {path} in {time.perf_counter() - t0:.1f}s")
    if rank0 and "experts" not in args.dims and not (path / "model.safetensors").exists():
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(args.device):  # random init on the GPU takes seconds, on CPU cores much longer
            model = AutoModelForCausalLM.from_config(hf_config(args.dims), dtype=getattr(torch, args.dtype))
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(path), safe_serialization=True)
        log(f"wrote random model to {path} in {time.perf_counter() - t0:.1f}s")
        del model
    if dist.is_initialized():
        dist.barrier()
    return path


def make_batch(args, device: str):
    import numpy as np

    from agentrl import types
    from agentrl.learners.batch import build_batch

    rng = np.random.default_rng(0)
    prompt = min(256, args.seq // 4)
    trajs = []
    for i in range(args.batch):
        ids = rng.integers(2, args.dims["vocab"], args.seq)
        traj = types.Trajectory(
            id=f"t{i}", group_id=f"g{i // 4}", prompt_ids=ids[:prompt].tolist(), response_ids=ids[prompt:].tolist(),
            reward=float(rng.random()), policy_version=0,
        )  # fmt: skip
        trajs.append(types.normalize(traj))
    return build_batch(trajs, pad_id=0, device=device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
