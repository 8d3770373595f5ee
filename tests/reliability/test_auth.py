"""Auth on the three HTTP servers (serve-queue, serve-engine, the OpenAI proxy), as real subprocesses:
a non-loopback bind without a token is refused; a missing, wrong or malformed token is a 401 on every
protected route while the health route stays open; the right token works (with agentrl's own clients too);
no token (right or wrong) ever shows in a server's output, `agentrl run --dry-run` or a run's config.toml."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import msgspec
import pytest

from tests.reliability.support import HERE, Raw, Served, env, error_message, figure, serve_queue_cmd
from tests.run_support import tiny_config

pytestmark = pytest.mark.slow

TOKEN = "tok-9f3a61c2e8b54d07a1"
WRONG = ["", "Bearer", "Bearer ", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", TOKEN,
         "Bearer wrong-7d1e0b", f"Token {TOKEN}"]  # fmt: skip


def refused(cmd: list[str], what: str, cli: bool = True) -> str:
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0, f"{what} started on a public address without a token: {text[-500:]}"
    assert "non-loopback" in text and "token" in text, text[-1000:]
    assert not cli or "Traceback" not in text, text[-2000:]  # a CLI prints one clear line
    assert not cli or "error:" in text
    return text


def check_routes(raw: Raw, protected: list[tuple[str, str, bytes | None, str]], open_path: str) -> int:
    """Every protected route: 401 + message + WWW-Authenticate for each wrong header; open route: 200."""
    n = 0
    for method, path, body, ctype in protected:
        for header in WRONG:
            headers = {"Content-Type": ctype, **({"Authorization": header} if header else {})}
            status, hdrs, data = raw.request(method, path, body, headers)
            assert status == 401, (path, header, status, data[:200])
            assert hdrs.get("WWW-Authenticate") == "Bearer"
            error_message(data)
            n += 1
    assert raw.request("GET", open_path)[0] == 200
    return n


def no_token_in(*texts: str) -> None:
    for text in texts:
        for secret in (TOKEN, TOKEN[:-1], "wrong-7d1e0b"):
            assert secret not in text, f"a token leaked: ...{text[max(0, text.find(secret) - 200) :][:400]}"


def test_public_bind_without_token_is_refused(tiny_model, tmp_path):
    refused(serve_queue_cmd(tmp_path / "q", "--host", "0.0.0.0"), "serve-queue")
    refused([sys.executable, "-m", "agentrl.cli", "serve-engine", "--model", tiny_model, "--host", "0.0.0.0",
             "--port", "0"], "serve-engine")  # fmt: skip
    code = ("import asyncio; from agentrl.tokenizer import load_tokenizer; "
            "from agentrl.proxy.server import OpenAIProxy; "
            f"p = OpenAIProxy([object()], load_tokenizer({tiny_model!r})); asyncio.run(p.start('0.0.0.0', 0))")  # fmt: skip
    refused([sys.executable, "-c", code], "the OpenAI proxy", cli=False)


def test_queue_token(serve_queue, tmp_path):
    served = serve_queue(AGENTRL_QUEUE_TOKEN=TOKEN)
    raw = Raw(served.url)
    body = msgspec.msgpack.encode({"id": "a1", "response_ids": [1, 2]})
    protected = [("POST", "/v1/trajectories", body, "application/msgpack"),
                 ("GET", "/v1/status", None, ""), ("GET", "/metrics", None, "")]  # fmt: skip
    n = check_routes(raw, protected, "/healthz")
    assert raw.request("GET", "/openapi.json")[0] == 200
    ok = {"Content-Type": "application/msgpack", "Authorization": f"Bearer {TOKEN}"}
    assert raw.request("POST", "/v1/trajectories", body, ok)[0] == 202
    assert raw.request("POST", "/v1/trajectories", b"\xc1", ok)[0] == 400  # errors after auth: still no leak
    from agentrl.queue.client import QueueClient

    assert QueueClient(served.url, token=TOKEN).submit([{"id": "a2", "response_ids": [3]}])["accepted"] == 1
    status = msgspec.json.decode(raw.request("GET", "/v1/status", None, ok)[2])
    assert status["depth"] == 2  # nothing sent with a wrong token got in
    served.stop()
    no_token_in(served.output())
    figure("auth.queue", refused_401=n, open_routes=["/healthz", "/openapi.json"], leaked=0)


def test_engine_token(tiny_model, tmp_path):
    cmd = [sys.executable, "-m", "agentrl.cli", "serve-engine", "--model", tiny_model, "--port", "0",
           "--threads", "1", "--max-seq-len", "128", "--max-batch-size", "4"]  # fmt: skip
    served = Served(cmd, r"serving (http://\S+)", tmp_path / "engine.log", AGENTRL_ENGINE_TOKEN=TOKEN)
    try:
        raw = Raw(served.url)
        gen = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}'
        protected = [("POST", "/generate", gen, "application/json"), ("GET", "/get_model_info", None, ""),
                     ("POST", "/update_weights_from_disk", b'{"model_path": "/"}', "application/json"),
                     ("POST", "/pause_generation", b"{}", "application/json")]  # fmt: skip
        n = check_routes(raw, protected, "/health")
        from agentrl.engines.base import SamplingParams
        from agentrl.engines.sglang import SGLangEngine

        async def client_calls(key: str) -> int:
            engine = SGLangEngine(served.url, request_timeout_s=30, api_key=key, retries=0)
            try:
                out = await engine.generate([1, 2], SamplingParams(max_new_tokens=2))
                return len(out.output_ids)
            finally:
                await engine.close()

        assert asyncio.run(client_calls(TOKEN)) == 2
        with pytest.raises(Exception, match=r"401|token"):
            asyncio.run(client_calls("wrong-7d1e0b"))
    finally:
        served.stop()
    no_token_in(served.output())
    figure("auth.engine", refused_401=n, open_routes=["/health", "/health_generate"], leaked=0)


def test_openai_proxy_token(tiny_model, tmp_path):
    served = Served([sys.executable, str(HERE / "proxy_main.py"), tiny_model, TOKEN], r"serving (http://\S+)",
                    tmp_path / "proxy.log")  # fmt: skip
    try:
        raw = Raw(served.url)
        chat = b'{"model": "m", "messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 2}'
        protected = [("POST", "/v1/sessions/s1/chat/completions", chat, "application/json"),
                     ("POST", "/v1/sessions/s1/reward", b'{"reward": 1}', "application/json"),
                     ("GET", "/v1/models", None, "")]  # fmt: skip
        n = check_routes(raw, protected, "/health")
        ok = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
        assert raw.request("POST", "/v1/sessions/s1/chat/completions", chat, ok)[0] == 200
        assert raw.request("POST", "/v1/sessions/s1/reward", b'{"reward": 1}', ok)[0] == 200
    finally:
        served.stop()
    no_token_in(served.output())
    figure("auth.openai_proxy", refused_401=n, open_routes=["/health"], leaked=0)


def test_run_never_writes_or_prints_the_token(tiny_model, tmp_path):
    from agentrl.config import load_config
    from agentrl.runner.rundir import RunDir

    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(f'[run]\nname = "t"\nroot = "{tmp_path}"\n[model]\npath = "{tiny_model}"\n')
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "run", str(cfg_path), "--dry-run",
                          "--queue.token", TOKEN], env=env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[queue]" in out.stdout
    no_token_in(out.stdout, out.stderr)
    cfg = load_config(cfg_path, ["--queue.token", TOKEN])
    rundir = RunDir(cfg)
    try:
        no_token_in((tmp_path / "t" / "config.toml").read_text())
    finally:
        rundir.close()
    assert cfg.queue.token == TOKEN  # the live config keeps it; only what is written is redacted


def test_blank_token_is_refused_at_start(tiny_model, tmp_path):
    """A whitespace-only token would start a queue that answers 401 to everyone: serve-queue and the queue of
    `agentrl run` refuse it, naming where it came from."""
    blank = env(AGENTRL_QUEUE_TOKEN=" \t ")
    out = subprocess.run(
        serve_queue_cmd(tmp_path / "q"), env=blank, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "$AGENTRL_QUEUE_TOKEN" in out.stderr and "Traceback" not in out.stderr
    cfg = tiny_config(tmp_path, tiny_model, run={"steps": 1, "eval_every": 0}, warmup={"steps": 0})
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "run", str(cfg)], env=blank, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2 and "queue.token" in out.stderr and "blank" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "ray" not in out.stderr.lower(), out.stderr[-2000:]  # before Ray
