"""`/openapi.json` states what the server enforces: checked by hand for the rules the issue named, then by
Schemathesis (all its checks: no server error, documented status codes and headers, response schemas,
schema-valid data accepted, schema-violating data refused, 405 with Allow, 401 without the token) against a
real `agentrl serve-queue` on loopback, with and without the run's tokenizer (chat form, vocabulary)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_queue_http import TOKEN, http, serve_queue_cmd

pytest.importorskip("schemathesis")

# the repo root, on the schemathesis process's PYTHONPATH: its hooks are tests.schemathesis_hooks
ROOT = Path(__file__).resolve().parents[1]
# every operation gets all checks at this count too (the coverage phase's boundary cases do not depend on it);
# 40 took 10 s more over the two forms
EXAMPLES_PER_OPERATION = 15


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from agentrl.engines.tiny import train_tokenizer

    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(vocab_size=400).save_pretrained(path)
    return str(path)


@pytest.fixture
def serve(tmp_path):
    procs = []

    def start(*args: str) -> str:
        cmd = [*serve_queue_cmd(), "--port", "0", "--run-dir", str(tmp_path / f"q{len(procs)}"), *args]
        env = {**os.environ, "AGENTRL_QUEUE_TOKEN": TOKEN}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        procs.append(proc)
        for line in proc.stdout:
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                return match.group(1)
        raise AssertionError("serve-queue did not start")

    yield start
    for proc in procs:
        proc.terminate()
        proc.communicate(timeout=20)
        assert proc.returncode == 0


def test_openapi_states_the_enforced_rules(serve, tokenizer_dir):
    url = serve("--model", tokenizer_dir, "--policy-version", "2")
    spec = http(url + "/openapi.json", token=None)[2]
    schemas = spec["components"]["schemas"]
    props = schemas["Trajectory"]["properties"]
    assert (props["id"]["minLength"], props["id"]["maxLength"]) == (1, 256)
    assert props["response_ids"]["minItems"] == 1 and props["response_ids"]["items"]["maximum"] == 399
    # JSON: a mask and a logprob per token, in the token's row (no lengths to match)
    assert "loss_mask" not in props and "logprobs" not in props and "versions" not in props
    assert props["response"]["items"]["prefixItems"] == [
        {"type": "integer", "minimum": 0, "maximum": 399},
        {"type": "integer", "minimum": 0, "maximum": 1},
        {"type": "number", "minimum": -1000.0, "maximum": 0.001},
    ]
    assert props["policy_version"]["anyOf"][0]["maximum"] == 2
    packed_props = schemas["TrajectoryMsgpack"]["properties"]
    assert packed_props["loss_mask"]["x-same-length-as"] == "response_ids"
    assert schemas["Message"]["properties"]["role"]["enum"] == sorted(
        ["system", "developer", "user", "assistant", "tool"]
    )
    packed = schemas["TrajectoryMsgpack"]["properties"]["response_ids"]["anyOf"][1]["allOf"][1]
    assert packed["properties"]["dtype"]["enum"] == ["uint8", "int32", "int64"]
    for path in ("/v1/status", "/metrics"):
        assert "401" in spec["paths"][path]["get"]["responses"]
    submit = spec["paths"]["/v1/trajectories"]["post"]["responses"]
    assert {"202", "400", "401", "408", "413", "415", "422", "429", "503", "507"} <= set(submit)
    assert submit["429"]["headers"]["Retry-After"]["required"]


@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["token-form", "chat-form"])
def test_schemathesis_finds_no_failure(serve, tokenizer_dir, tmp_path, with_tokenizer):
    url = serve(*(["--model", tokenizer_dir, "--policy-version", "2"] if with_tokenizer else []))
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all",
           "--header", f"Authorization: Bearer {TOKEN}", "--max-examples", str(EXAMPLES_PER_OPERATION),
           "--seed", "1", "--workers", "1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    report = out.stdout + out.stderr
    assert out.returncode == 0 and "No issues found" in report, report[-6000:]
    tested = re.search(r"(\d+) generated, (\d+) passed", report)
    assert tested and int(tested.group(1)) >= EXAMPLES_PER_OPERATION, report[-2000:]
