"""`agentrl eval --engine URL` samples through a running server (here `serve-engine`'s app on loopback, over the
same tiny model) and scores what the embedded engine scores: greedy, the same replies token for token."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

from agentrl.cli import main
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.server import EngineServer
from tests.run_support import read_jsonl

FLAGS = ["--env", "calculator", "--prompts", "3", "--json", "--rollout.max-new-tokens", "10",
         "--engine.max-seq-len", "256", "--env.reward", "tests.run_support:letters_reward"]  # fmt: skip


@pytest.fixture
def served(tiny):
    """serve-engine's HTTP app over an embedded engine, on a loop of its own thread (the command under test runs
    its own event loop)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = EngineServer(EmbeddedEngine(str(tiny), max_seq_len=256))
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    yield url
    asyncio.run_coroutine_threadsafe(server.stop(close_engine=True), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def evaluate(capsys, tiny, out, *extra: str) -> dict:
    threads = torch.get_num_threads()  # the command pins them (run.torch_threads), as in its own process
    try:
        assert main(["eval", str(tiny), *FLAGS, "--out", str(out), *extra]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_engine_url_scores_like_the_embedded_engine(capsys, tiny, served, tmp_path):
    remote = evaluate(capsys, tiny, tmp_path / "remote.jsonl", "--engine", served)
    local = evaluate(capsys, tiny, tmp_path / "local.jsonl")
    assert remote == local and remote["calculator"]["samples"] == 3.0
    replies = [(r["prompt_index"], r["response"], r["reward"]) for r in read_jsonl(tmp_path / "remote.jsonl")]
    assert replies == [
        (r["prompt_index"], r["response"], r["reward"]) for r in read_jsonl(tmp_path / "local.jsonl")
    ]
    assert all(text for _, text, _ in replies)
