"""Top-k logprobs from the engines: the embedded engine's top k of each generated token are the k largest
values of `log_softmax(logits / T)` that transformers computes for the same prefix (the distribution whose
logprob the engine reports for the sampled token), and `serve-engine` carries them over HTTP in SGLang's
`top_logprobs_num` / `meta_info.output_top_logprobs`, read back by the SGLang client unchanged."""

import asyncio

import pytest
import torch

from agentrl.engines.base import InvalidRequest, SamplingParams
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.server import EngineServer
from agentrl.engines.sglang import SGLangEngine

torch.set_num_threads(1)
PROMPT = [5, 17, 42, 9]


@pytest.fixture(scope="module")
def hf_model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()


def reference_logprobs(model, prompt, output, temperature):
    """transformers' log_softmax(logits / T) before each output token: [len(output), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)[len(prompt) - 1 : -1]


def check_against_reference(out, hf_model, temperature, k, tol=1e-4):
    """Each reported (id, logprob) is the reference's logprob of that id, and the values are the reference's k
    largest (ids are not compared directly: near-ties may order differently across devices)."""
    assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.output_ids)
    ref = reference_logprobs(hf_model, PROMPT, out.output_ids, temperature)
    for top, row, token, logprob in zip(out.top_logprobs, ref, out.output_ids, out.logprobs, strict=True):
        assert len(top) == k and len({t for t, _ in top}) == k
        assert [v for _, v in top] == pytest.approx(row.topk(k).values.tolist(), abs=tol)
        assert [v for _, v in top] == pytest.approx([float(row[t]) for t, _ in top], abs=tol)
        assert float(row[token]) == pytest.approx(logprob, abs=tol)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graphs, fused sampler)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
async def test_embedded_engine_reports_the_true_top_k(tiny, hf_model, temperature, device):
    engine = EmbeddedEngine(str(tiny), device=device, max_seq_len=64, max_batch_size=4)
    try:
        asked = SamplingParams(
            temperature=temperature, max_new_tokens=6, top_logprobs=5, ignore_eos=True, seed=3
        )
        plain = SamplingParams(max_new_tokens=4, ignore_eos=True)
        out, other = await asyncio.gather(engine.generate(PROMPT, asked), engine.generate([1, 2], plain))
        check_against_reference(out, hf_model, temperature, 5, 1e-4 if device == "cpu" else 2e-3)
        assert other.top_logprobs is None  # a row that did not ask gets none, in the same batch
        with pytest.raises(InvalidRequest, match="top_logprobs_num"):
            await engine.generate(PROMPT, SamplingParams(top_logprobs=-1))
    finally:
        await engine.close()


async def test_serve_engine_and_sglang_client_carry_top_logprobs(tiny, hf_model):
    server = EngineServer(EmbeddedEngine(str(tiny), max_seq_len=64, max_batch_size=4))
    url = await server.start()
    client = SGLangEngine(url)
    try:
        sampling = SamplingParams(temperature=0.0, max_new_tokens=5, top_logprobs=3, ignore_eos=True)
        out = await client.generate(PROMPT, sampling, request_id="top-1")
        check_against_reference(out, hf_model, 0.0, 3)
        assert (await client.generate(PROMPT, SamplingParams(max_new_tokens=2))).top_logprobs is None
    finally:
        await client.close()
        await server.stop(close_engine=True)
