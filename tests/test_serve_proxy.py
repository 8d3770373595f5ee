"""`agentrl serve-proxy` as a real process in front of a real `serve-engine` process, driven with the official
`openai` SDK over loopback; closed sessions land in a JSONL file or in a `serve-queue` process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
URL = re.compile(r"(http://[0-9.]+:\d+)")


@contextmanager
def serving(args: list[str], marker: str, env: dict | None = None):
    """A server subprocess; yields (process, its URL from the line containing `marker`)."""
    proc = subprocess.Popen([sys.executable, *args], env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if marker in line and URL.search(line):
                yield proc, URL.search(line).group(1)
                break
        else:
            raise AssertionError(f"{args[1:3]} exited: {''.join(lines)[-2000:]}")
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def engine_url(tiny):
    with serving(["-m", "agentrl.engines.cli", "--model", tiny, "--port", "0", "--max-seq-len", "512"],
                 "serving") as (_, url):  # fmt: skip
        yield url


def proxy_args(engine_url: str, tiny: str, sink: str, *extra: str) -> list[str]:
    return ["-m", "agentrl.cli", "serve-proxy", "--engine", engine_url, "--model", tiny, "--sink", sink,
            "--port", "0", "--max-new-tokens", "8", "--max-seq-len", "512", *extra]  # fmt: skip


def chat(proxy_url: str, sid: str, api_key: str = "unused") -> str:
    client = openai.OpenAI(base_url=f"{proxy_url}/v1/sessions/{sid}", api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(
        model="agentrl", messages=[{"role": "user", "content": "What is 2+3?"}]
    )
    return reply.choices[0].message.content


def test_serve_proxy_records_sessions_into_a_jsonl_file(engine_url, tiny, tok, tmp_path):
    sink = tmp_path / "trajectories.jsonl"
    with serving(proxy_args(engine_url, tiny, str(sink)), "agentrl serve-proxy: serving") as (_, url):
        text = chat(url, "s1")
        resp = requests.post(f"{url}/v1/sessions/s1/reward", json={"reward": 0.5})
        assert resp.status_code == 200 and resp.json()["trajectory_ids"] == ["s1"]
        assert requests.post(f"{url}/v1/sessions/s1/reward", json={"reward": 1}).status_code == 404
    rows = [json.loads(line) for line in sink.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["id"] == "s1" and rows[0]["reward"] == 0.5
    response, mask = np.array(rows[0]["response_ids"]), np.array(rows[0].get("loss_mask", []))
    generated = response if mask.size == 0 else response[mask == 1]
    assert tok.decode(generated.tolist()).startswith(text)
    assert tok.decode(rows[0]["prompt_ids"]).endswith("What is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_serve_proxy_sampling_policy_flag(engine_url, tiny, tmp_path):
    """--proxy-sampling override: a request's temperature is recorded, the run's is sampled with."""
    sink = tmp_path / "override.jsonl"
    with serving(proxy_args(engine_url, tiny, str(sink), "--proxy-sampling", "override"),
                 "agentrl serve-proxy: serving") as (_, url):  # fmt: skip
        client = openai.OpenAI(base_url=f"{url}/v1/sessions/o", api_key="unused", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.3,
                                       max_tokens=100000, stop=["\n\n\n"])  # fmt: skip
        assert requests.post(f"{url}/v1/sessions/o/reward", json={"reward": 1.0}).status_code == 200
        formats = requests.get(f"{url}/openapi.json").json()["components"]["schemas"]["ResponseFormat"]
        assert formats["properties"]["type"]["const"] == "text"  # serve-engine has no structured output
    (row,) = [json.loads(line) for line in sink.read_text().splitlines()]
    assert row["metadata"]["requested_sampling"] == [{"temperature": 0.3}]
    assert row["metadata"]["max_tokens_capped"][0]["asked"] == 100000


def test_serve_proxy_submits_to_serve_queue_with_tokens(engine_url, tiny, tmp_path):
    queue_env = {"AGENTRL_QUEUE_TOKEN": "qsecret"}
    queue_args = ["-m", "agentrl.cli", "serve-queue", "--port", "0", "--run-dir", str(tmp_path / "q"),
                  "--model", tiny]  # fmt: skip
    with serving(queue_args, "listening on", queue_env) as (_, queue_url):
        args = proxy_args(engine_url, tiny, queue_url, "--token", "psecret")
        with serving(args, "agentrl serve-proxy: serving", queue_env) as (_, url):
            with pytest.raises(openai.AuthenticationError):
                chat(url, "s2", api_key="wrong")
            text = chat(url, "s2", api_key="psecret")
            assert isinstance(text, str)
            auth = {"Authorization": "Bearer psecret"}
            resp = requests.post(f"{url}/v1/sessions/s2/reward", json={"reward": 1.0}, headers=auth)
            assert resp.status_code == 200, resp.text
        status = requests.get(f"{queue_url}/v1/status", headers={"Authorization": "Bearer qsecret"}).json()
    assert status["counts"]["accepted"] == 1, status


@pytest.mark.parametrize(
    "extra, flag",
    [(["--host", "0.0.0.0"], "--host"), (["--top-p", "2"], "--top-p"), (["--port", "70000"], "--port"),
     (["--max-seq-len", "0"], "--max-seq-len")],
)  # fmt: skip
def test_bad_flags_name_the_flag(tiny, tmp_path, extra, flag):
    args = proxy_args("http://127.0.0.1:9", tiny, str(tmp_path / "x.jsonl"), *extra)
    done = subprocess.run([sys.executable, *args], env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and flag in done.stderr, done.stderr


def test_an_engine_that_does_not_answer_is_named(tiny, tmp_path):
    args = proxy_args("http://127.0.0.1:9", tiny, str(tmp_path / "x.jsonl"), "--request-timeout-s", "2")
    done = subprocess.run([sys.executable, *args], env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--engine http://127.0.0.1:9" in done.stderr, done.stderr
