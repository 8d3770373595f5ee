"""Tensor and pipeline parallel conversion on CPU: 2 gloo processes, no GPU needed.

TP = 2: each rank loads its shard of the HF weights (QKV per query group, gate/up, vocab), `iter_hf` gathers
them back bit-exactly, the TP forward equals the HF model, and the vocab-parallel log-prob / entropy ops equal the
full-vocabulary computation. PP = 2: each stage holds half the layers and streaming broadcasts the other half.
"""

import json
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from agentrl.engines.tiny import make_tiny_model
from agentrl.net import free_port
from tests.megatron_helpers import write_model


def _worker(rank: int, world: int, runs: list[tuple[int, int, str]], port: int, out_dir: str) -> None:
    import os

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method="env://")
    results = []
    for tp, pp, model_dir in runs:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        results.append(_check(tp, pp, model_dir))
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _check(tp: int, pp: int, model_dir: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentrl.learners.megatron import convert, cpu_compat, ops
    from agentrl.learners.megatron.checkpoint import hf_reader
    from agentrl.learners.megatron.model import ArchSpec, build_gpt

    cpu_compat.install(0)
    arch = ArchSpec.from_hf(AutoConfig.from_pretrained(model_dir))
    model = build_gpt(arch)
    result = {"local_layers": len(model.decoder.layers)}
    with hf_reader(model_dir) as get:
        convert.load_hf(model, arch, get, ps.get_tensor_model_parallel_rank(), tp)
        streamed = list(convert.iter_hf(model, arch))
        result["names"] = [n for n, _ in streamed]
        result["mismatched"] = [n for n, t in streamed if not torch.equal(t, get(n))]
    if pp == 1:
        ids = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.no_grad():
            logits = model(ids, None, None)  # [b, s, V / tp]
            ref = hf(ids).logits
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            result["logits_diff"] = float((torch.cat(parts, -1) - ref).abs().max())
            logp = torch.log_softmax(ref[:, :-1] / 0.8, -1)
            want_lp = torch.nn.functional.pad(logp.gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
            want_ent = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))
            result["entropy_diff"] = float((ops.entropy(logits, 0.8) - want_ent).abs().max())
            result["logprob_diff"] = float((ops.target_logprobs(logits, ids, 0.8) - want_lp).abs().max())
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One pair of processes runs TP = 2 (qwen2), PP = 2 (qwen3) and TP = 2 (llama, attention biases); all untied (a tied PP model copies
    the embedding to the last stage with `.cuda()`: that path runs in test_megatron_ddp_cpu.py)."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("megatron-parallel")
    kw = dict(seed=2, hidden=64, layers=2, heads=4, kv_heads=2, vocab_size=300, init_std=0.2)
    qwen2 = make_tiny_model(tmp / "qwen2", "qwen2", tie_embeddings=False, **kw)
    qwen3 = make_tiny_model(tmp / "qwen3", "qwen3", tie_embeddings=False, **kw)
    llama = write_model(tmp / "llama", "llama", False, {"attention_bias": True}, seed=2)  # q/k/v/o biases
    runs = [(2, 1, str(qwen2)), (1, 2, str(qwen3)), (2, 1, str(llama))]
    mp.spawn(_worker, args=(2, runs, free_port(), str(tmp)), nprocs=2)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_tensor_parallel_2_load_stream_forward(results):
    for rank in results:
        res = rank[0]
        assert res["mismatched"] == [] and "lm_head.weight" in res["names"] and len(res["names"]) == 27
        assert res["logits_diff"] <= 1e-4
        assert res["logprob_diff"] <= 1e-4 and res["entropy_diff"] <= 1e-4


def test_pipeline_parallel_2_streams_every_stage(results):
    for rank in results:
        res = rank[1]
        assert res["mismatched"] == [] and "lm_head.weight" in res["names"] and len(res["names"]) == 25
        assert res["local_layers"] == 1  # each stage builds only its half of the 2 layers
        assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.mlp.down_proj.weight"} <= set(
            res["names"]
        )


def test_tensor_parallel_2_replicates_the_o_proj_bias(results):
    for rank in results:
        res = rank[2]
        assert res["mismatched"] == [] and "model.layers.1.self_attn.o_proj.bias" in res["names"]
        assert res["logits_diff"] <= 1e-4 and res["logprob_diff"] <= 1e-4
