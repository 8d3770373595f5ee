"""SGLang client contract tests against `agentrl serve-engine` in a subprocess, and the launcher."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from agentrl.config.rollout import SGLangSection
from agentrl.engines.base import DiskSource, InvalidRequest, SamplingParams, TensorSource
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_launcher import SGLangServer, parse_sglang_flags, sglang_argv
from agentrl.engines.tiny import make_tiny_model
from agentrl.errors import ConfigError, EngineError, WeightSyncError
from agentrl.net import free_port

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_new_tokens=1000, ignore_eos=True)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sgl")
    return make_tiny_model(root / "a", seed=1, init_std=0.1), make_tiny_model(
        root / "b", seed=2, init_std=0.1
    )


@pytest.fixture(scope="module")
def server_url(dirs):
    cmd = [sys.executable, "-m", "agentrl.engines.cli", "--model", str(dirs[0]), "--port", "0",
           "--max-batch-size", "8", "--max-seq-len", "1024", "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    line = ""
    for line in proc.stdout:
        if "serving http" in line:
            break
    else:
        proc.kill()
        pytest.fail(f"serve-engine did not start: {line}")
    yield line.strip().rsplit(" ", 1)[-1]
    proc.terminate()
    proc.wait(10)


async def local_outputs(path, prompts, sp):
    engine = EmbeddedEngine(str(path), max_batch_size=8, max_seq_len=1024)
    outs = [await engine.generate(p, sp) for p in prompts]
    await engine.close()
    return outs


async def reset(client, dirs):
    await client.resume()
    await client.update_weights(0, DiskSource(str(dirs[0])))


async def test_generate_matches_the_embedded_engine(server_url, dirs):
    client = SGLangEngine(server_url)
    await reset(client, dirs)
    prompts = [[1, 2, 3], [4, 5], [6]]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=3, ignore_eos=True)
    remote = await asyncio.gather(*[client.generate(p, seeded) for p in prompts])
    local = await local_outputs(dirs[0], prompts, seeded)
    for r, lo in zip(remote, local, strict=True):
        assert r.output_ids == lo.output_ids and r.finish_reason == "length" and r.versions == [(0, 12)]
        assert (
            max(abs(a - b) for a, b in zip(r.logprobs, lo.logprobs, strict=True)) <= 1e-5
        )  # batched vs alone
        assert r.prompt_tokens == lo.prompt_tokens
    assert (await client.health())["ok"]
    await client.close()


async def test_invalid_requests_and_unreachable_servers(server_url):
    client = SGLangEngine(server_url)
    with pytest.raises(InvalidRequest, match="input_ids") as info:
        await client.generate([], GREEDY)
    assert info.value.field == "input_ids"
    with pytest.raises(InvalidRequest) as info:
        await client.generate([1], SamplingParams(max_new_tokens=0))
    assert info.value.field == "sampling_params.max_new_tokens"
    await client.close()
    dead = SGLangEngine(f"http://127.0.0.1:{free_port()}", retries=1)
    with pytest.raises(EngineError, match=r"127\.0\.0\.1:\d+/generate"):
        await dead.generate([1], GREEDY)
    with pytest.raises(WeightSyncError, match="/update_weights_from_disk"):
        await dead.update_weights(1, DiskSource("/x"))
    assert (await dead.health())["ok"] is False
    await dead.close()


async def test_request_timeout_names_the_route(server_url):
    client = SGLangEngine(server_url, request_timeout_s=0.05)
    with pytest.raises(EngineError, match=r"/generate: no answer within"):
        await client.generate(list(range(1, 9)), LONG)
    await client.close()


async def test_hot_reload_from_disk_and_tensor(server_url, dirs):
    from transformers import AutoModelForCausalLM

    client = SGLangEngine(server_url)
    await reset(client, dirs)
    prompt = [3, 1, 4]
    a = await client.generate(prompt, GREEDY)
    await client.update_weights(1, DiskSource(str(dirs[1])))
    b = await client.generate(prompt, GREEDY)
    expected_b = (await local_outputs(dirs[1], [prompt], GREEDY))[0]
    assert b.output_ids == expected_b.output_ids != a.output_ids and b.versions == [(1, 10)]
    weights_a = dict(AutoModelForCausalLM.from_pretrained(dirs[0]).named_parameters())
    await client.update_weights(2, TensorSource(weights_a))
    assert client.tensor_format == "agentrl"
    again = await client.generate(prompt, GREEDY)
    assert again.output_ids == a.output_ids and again.versions == [(2, 10)] and client.policy_version == 2
    with pytest.raises(WeightSyncError, match=r"update_weights_from_tensor.*model\.bogus"):
        await client.update_weights(3, TensorSource({"model.bogus": torch.zeros(1)}))
    assert client.policy_version == 2
    await client.close()


async def wait_running(client, min_steps=5):
    """Until the server runs a request and has decoded `min_steps` more steps (serve-engine's /health)."""
    start = None
    while True:
        info = await client._call("GET", "/health")
        if info["running"]:
            start = info["steps"] if start is None else start
            if info["steps"] - start >= min_steps:
                return
        await asyncio.sleep(0.002)


async def test_pause_keep_update_resume_switches_versions(server_url, dirs):
    client = SGLangEngine(server_url)
    await reset(client, dirs)
    task = asyncio.create_task(client.generate([7, 7], LONG, request_id="keep"))
    await wait_running(client)
    await client.pause("keep")
    assert not task.done()
    await client.update_weights(5, DiskSource(str(dirs[1])))
    await client.resume()
    out = await task
    assert out.finish_reason == "length" and len(out.output_ids) == 1000
    assert [v for v, _ in out.versions] == [0, 5] and sum(n for _, n in out.versions) == 1000
    await client.close()


async def test_pause_abort_and_wait_and_abort_by_id(server_url, dirs):
    client = SGLangEngine(server_url)
    await reset(client, dirs)
    task = asyncio.create_task(client.generate([7, 8], LONG, request_id="ab"))
    await wait_running(client)
    await client.pause("abort")
    out = await task
    assert out.finish_reason == "abort" and 5 <= len(out.output_ids) < 1000
    await client.resume()
    task = asyncio.create_task(client.generate([7, 9], LONG, request_id="byid"))
    await wait_running(client)
    await client.abort("byid")
    assert (await task).finish_reason == "abort"
    mid = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)
    task = asyncio.create_task(client.generate([5], mid))
    await wait_running(client, 1)
    await client.pause("wait")  # waits for this client's in-flight request to finish
    assert task.done() and task.result().finish_reason == "length" and len(task.result().output_ids) == 60
    late = asyncio.create_task(client.generate([5], GREEDY))
    await asyncio.sleep(0.1)
    assert not late.done()
    await client.resume()
    assert len((await late).output_ids) == 10
    await client.flush_cache()
    await client.close()


async def test_pause_abort_returns_after_every_request_came_back(server_url, dirs):
    """pause("abort") aborts and drains this client's requests itself (SGLang's own abort pause polls once a
    second): when it returns, every request has its partial answer, and new ones wait for resume()."""
    client = SGLangEngine(server_url)
    await reset(client, dirs)
    tasks = [asyncio.create_task(client.generate([7, 8 + i], LONG)) for i in range(6)]
    await wait_running(client)
    await client.pause("abort")
    assert all(t.done() for t in tasks) and client._in_flight == 0
    assert {t.result().finish_reason for t in tasks} == {"abort"}
    held = asyncio.create_task(client.generate([5], GREEDY))
    await asyncio.sleep(0.1)
    assert not held.done()
    await client.resume()
    assert len((await held).output_ids) == 10
    await client.close()


async def test_distributed_update_through_http(server_url, dirs):
    from transformers import AutoModelForCausalLM

    from agentrl.engines.weight_sync import init_weights_update_group, send_broadcast

    client = SGLangEngine(server_url)
    await reset(client, dirs)
    port = free_port()
    named = [
        (n, p.detach().clone()) for n, p in AutoModelForCausalLM.from_pretrained(dirs[1]).named_parameters()
    ]
    result = {}

    def trainer():
        group = init_weights_update_group("127.0.0.1", port, 0, 2, group_name="wg")
        result["source"] = (
            send_broadcast(group, named) if result.setdefault("go", threading.Event()).wait(30) else None
        )

    result["go"] = threading.Event()
    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    await client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="wg", backend="gloo")
    from agentrl.engines.weight_sync import describe

    result["go"].set()
    await client.update_weights(9, describe("wg", named))
    thread.join(30)
    out = await client.generate([3, 1, 4], GREEDY)
    assert out.output_ids == (await local_outputs(dirs[1], [[3, 1, 4]], GREEDY))[0].output_ids
    assert out.versions == [(9, 10)]
    await client.close()


def test_flag_passthrough_argv():
    args, rest = parse_sglang_flags(
        ["--run.steps", "3", "--sglang-mem-fraction-static", "0.7", "--sglang-disable-radix-cache",
         "--sglang-attention-backend=triton", "--sglang-tp-size", "2"]
    )  # fmt: skip
    assert rest == ["--run.steps", "3"]
    assert args == {
        "mem_fraction_static": 0.7,
        "disable_radix_cache": True,
        "attention_backend": "triton",
        "tp_size": 2,
    }
    argv = sglang_argv("py", "/m", "127.0.0.1", 30000, {**args, "skip_server_warmup": True, "enable_foo": False,
                                                         "cuda_graph_bs": [1, 2], "json_model_override_args": {"a": 1}})  # fmt: skip
    assert argv[:9] == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
    ]
    tail = " ".join(argv[9:])
    assert tail == ("--mem-fraction-static 0.7 --disable-radix-cache --attention-backend triton --tp-size 2 "
                    '--skip-server-warmup --cuda-graph-bs 1 2 --json-model-override-args {"a": 1}')  # fmt: skip
    with pytest.raises(ConfigError, match=r"engine\.sglang\.args\.port"):
        sglang_argv("py", "/m", "h", 1, {"port": 5})


FAKE_SGLANG = textwrap.dedent(
    """
    import argparse, json, os, sys
    from agentrl.engines import cli
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args, unknown = parser.parse_known_args()
    with open(os.environ["FAKE_SGLANG_ARGV"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    if os.environ.get("FAKE_SGLANG_FAIL"):
        print("boom: cannot start", flush=True)
        sys.exit(3)
    args.threads = 1
    sys.exit(cli.main(args))
    """
)


@pytest.fixture
def fake_sglang(tmp_path):
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SGLANG)
    env = {"PYTHONPATH": f"{tmp_path / 'fake'}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
           "FAKE_SGLANG_ARGV": str(tmp_path / "argv.jsonl")}  # fmt: skip
    return env, tmp_path


async def test_launcher_starts_and_restarts_a_crashed_server(dirs, fake_sglang):
    import json

    env, tmp = fake_sglang
    cfg = SGLangSection(python=sys.executable, args={"mem_fraction_static": 0.7, "skip_server_warmup": True},
                        startup_timeout_s=60, restart_on_crash=True)  # fmt: skip
    server = SGLangServer(str(dirs[0]), cfg, env=env, log_path=str(tmp / "sglang.log"))
    url = await asyncio.to_thread(server.start)
    client = SGLangEngine(url)
    try:
        assert len((await client.generate([1, 2], GREEDY)).output_ids) == 10
        argv = json.loads((tmp / "argv.jsonl").read_text().splitlines()[0])
        assert argv[-3:] == ["--mem-fraction-static", "0.7", "--skip-server-warmup"]
        first = server.pid
        os.killpg(first, signal.SIGKILL)
        for _ in range(600):
            await asyncio.sleep(0.1)
            if server.restarts == 1 and (await client.health())["ok"]:
                break
        assert server.restarts == 1 and server.pid != first
        assert len((await client.generate([1, 2], GREEDY)).output_ids) == 10
    finally:
        await client.close()
        server.stop()
    assert server.returncode is not None


async def test_launcher_reports_a_failed_start_with_the_log(dirs, fake_sglang):
    env, tmp = fake_sglang
    cfg = SGLangSection(python=sys.executable, startup_timeout_s=30, restart_on_crash=False)
    server = SGLangServer(
        str(dirs[0]), cfg, env={**env, "FAKE_SGLANG_FAIL": "1"}, log_path=str(tmp / "bad.log")
    )
    with pytest.raises(EngineError, match=r"exited with code 3(.|\n)*boom: cannot start"):
        server.start()
    server.stop()
    timeout = SGLangServer(str(dirs[0]), cfg, env=env, log_path=str(tmp / "slow.log"), startup_timeout_s=0.5,
                           python=sys.executable, args={"model_path_x": 1})  # fmt: skip
    timeout.argv = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(30)"]
    with pytest.raises(EngineError, match=r"startup_timeout_s=0.5s(.|\n)*loading"):
        timeout.start()
    assert timeout.returncode is not None


async def test_connect_attaches_to_external_urls(dirs):
    from agentrl.config.rollout import EngineSection
    from agentrl.engines.sglang_launcher import connect

    urls, servers = await connect(
        EngineSection(kind="sglang", external_urls=["http://a:1", "http://b:2"]), str(dirs[0])
    )
    assert urls == ["http://a:1", "http://b:2"] and servers == []


def test_server_port_leaves_room_for_sglang_grpc_port_and_keeps_nccl_cumem(monkeypatch, tmp_path):
    from agentrl.engines.sglang_launcher import SERVER_PORTS, SGLangServer

    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    ports = {SGLangServer("/m", log_path=str(tmp_path / "s.log")).port for _ in range(20)}
    assert all(SERVER_PORTS[0] <= p <= SERVER_PORTS[1] and p + 10_000 <= 65_535 for p in ports)
    assert SGLangServer("/m").env["NCCL_CUMEM_ENABLE"] == "1"  # else SGLang sets 0 and NCCL P2P IPC fails
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    assert SGLangServer("/m").env["NCCL_CUMEM_ENABLE"] == "0"  # the user's choice wins
