"""Real SGLang on one GPU: how it holds request ids across abort and pause (what `serve-engine` models, see
docs/engines.md "Request ids"), and the abort path end to end (SGLangEngine + multi_turn + weight
publishes in `abort` mode while requests run and wait queued). Prints one JSON summary; exit 1 if a check
fails.
    python3 -m tests.gpu_sglang_abort_ids OUT_DIR   # after `gpu_install sglang` (bench/gpu/common.sh); pytest: tests/test_gpu_sglang.py
The server runs at most 2 requests at a time (`--max-running-requests 2`), so the others wait queued.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import aiohttp

from agentrl.actors.broadcast import load_into_engines
from agentrl.config.rollout import SGLangSection
from agentrl.engines.base import DiskSource
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_launcher import SGLangServer
from agentrl.engines.tiny import make_tiny_model
from agentrl.generator import resolve_generator
from agentrl.types import expand_versions, floats, n_response
from tests.gen_support import calculator_context

FLAGS = {
    "dtype": "bfloat16", "attention_backend": "triton", "sampling_backend": "pytorch",
    "grammar_backend": "none", "disable_piecewise_cuda_graph": True, "skip_server_warmup": True,
    "skip_tokenizer_init": True,
    "mem_fraction_static": 0.3, "max_running_requests": 2, "disable_cuda_graph": True,
}  # fmt: skip
LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
TASK = {"a": 23, "b": 45, "op": "+", "answer": 68}


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url, json=body) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, {"text": text}


def gen(rid: str, prompt: list[int], params: dict = LONG) -> dict:
    return {"input_ids": prompt, "rid": rid, "sampling_params": params, "return_logprob": True}


async def id_lifecycle(url: str) -> dict:
    """A queued request aborted keeps its id; a running one aborted frees it; a request sent during a pause is
    registered at once (a second one with its id is refused) and an abort does not reach it."""
    out: dict = {}
    async with aiohttp.ClientSession() as s:
        running = [
            asyncio.create_task(post(s, url + "/generate", gen(f"run{i}", [1, 2 + i]))) for i in range(2)
        ]
        await asyncio.sleep(1.0)
        queued = asyncio.create_task(post(s, url + "/generate", gen("q", [1, 9])))
        await asyncio.sleep(0.5)
        await post(s, url + "/abort_request", {"abort_all": True})
        answers = {rid: await t for rid, t in zip(["run0", "run1", "q"], [*running, queued], strict=True)}
        out["aborted_tokens"] = {rid: len(body.get("output_ids", [])) for rid, (_, body) in answers.items()}
        out["aborted_reasons"] = {
            rid: body["meta_info"]["finish_reason"] for rid, (_, body) in answers.items()
        }
        short = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        out["resend_queued"] = await post(s, url + "/generate", gen("q", [1, 9], short))
        out["resend_running"] = (await post(s, url + "/generate", gen("run0", [1, 2], short)))[0]
        await post(s, url + "/pause_generation", {"mode": "abort"})
        parked = asyncio.create_task(
            post(s, url + "/generate", gen("p", [1, 3], {**short, "max_new_tokens": 50}))
        )
        await asyncio.sleep(0.5)
        out["duplicate_of_parked"] = await post(s, url + "/generate", gen("p", [1, 3], short))
        await post(s, url + "/abort_request", {"abort_all": True})
        await post(s, url + "/abort_request", {"rid": "p"})
        await asyncio.sleep(0.5)
        out["parked_done_before_continue"] = parked.done()
        await post(s, url + "/continue_generation", {})
        status, body = await parked
        out["parked_after_continue"] = [
            status,
            len(body.get("output_ids", [])),
            body["meta_info"]["finish_reason"],
        ]
    return out


class Outcomes(SGLangEngine):
    def __init__(self, url: str):
        super().__init__(url)
        self.outcomes: list[tuple[str | None, str, int]] = []

    async def generate(self, input_ids, sampling, request_id=None):
        result = await super().generate(input_ids, sampling, request_id)
        self.outcomes.append((request_id, result.finish_reason, len(result.output_ids)))
        return result


async def abort_path(url: str, models: list[Path], episodes: int = 8, publishes: int = 3) -> dict:
    client = Outcomes(url)
    ctx = calculator_context(client, models[0], max_new_tokens=1500, max_seq_len=2000)
    generate = resolve_generator("multi_turn")
    tasks = [asyncio.create_task(generate(ctx, TASK, f"t0-s{k}", "t0")) for k in range(episodes)]
    for version in range(1, publishes + 1):
        await asyncio.sleep(0.4)
        await load_into_engines([client], version, DiskSource(str(models[version % 2])), "abort")
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    trajs = [r for r in results if not isinstance(r, BaseException)]
    ids = [rid for rid, _, _ in client.outcomes]
    consistent = all(
        len(floats(t.logprobs)) == n_response(t) == sum(c for _, c in t.versions)
        and list(expand_versions(t.versions, n_response(t)))
        == sorted(expand_versions(t.versions, n_response(t)))
        for t in trajs
    )
    return {
        "errors": errors,
        "statuses": dict(Counter(t.status for t in trajs)),
        "requests": len(ids),
        "duplicate_ids_sent": [rid for rid, n in Counter(ids).items() if n > 1],
        "aborts_without_tokens": sum(1 for _, r, n in client.outcomes if r == "abort" and n == 0),
        "aborts_with_tokens": sum(1 for _, r, n in client.outcomes if r == "abort" and n > 0),
        "versions_seen": sorted({v for t in trajs for v, _ in t.versions}),
        "arrays_consistent": consistent,
    }


async def main(out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    models = [make_tiny_model(Path(tempfile.mkdtemp()) / f"m{seed}", seed=seed) for seed in (1, 2)]
    server = SGLangServer(str(models[0]), SGLangSection(args=FLAGS), log_path=str(out_dir / "sglang.log"))
    url = await asyncio.to_thread(server.start)
    try:
        summary = {"id_lifecycle": await id_lifecycle(url), "abort_path": await abort_path(url, models)}
    finally:
        server.stop()
    life, path = summary["id_lifecycle"], summary["abort_path"]
    tokens, resent = life["aborted_tokens"], life["resend_queued"]
    summary["checks"] = checks = {
        "queued abort: no tokens, id kept": tokens["q"] == 0 and resent[0] == 400
        and "Duplicate request ID" in json.dumps(resent[1]),
        "running abort: tokens, id freed": min(tokens["run0"], tokens["run1"]) > 0
        and life["resend_running"] == 200,
        "parked in pause: registered, not aborted": life["duplicate_of_parked"][0] == 400
        and not life["parked_done_before_continue"] and life["parked_after_continue"][1] == 50,
        "abort path: no errors, no id twice, queued aborts seen": not path["errors"]
        and not path["duplicate_ids_sent"] and path["aborts_without_tokens"] > 0
        and path["arrays_consistent"],
    }  # fmt: skip
    print(json.dumps(summary, indent=1, default=str))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/sglang_abort_ids"))))
