"""`agentrl serve-engine`'s `/openapi.json` states what the server enforces: checked by hand for the rules the
engine adds to the wire types, then by Schemathesis (all its checks: no server error, documented status codes,
headers and response schemas, schema-valid bodies accepted, schema-violating ones refused, 405 with Allow,
401 without the token) against a real `serve-engine` subprocess on the tiny model over loopback.

Left out of the Schemathesis run (still documented): the weight routes (they need a real model directory, a
real safetensors payload or a peer process for the broadcast group, which `init_weights_update_group` blocks
waiting for) and `/pause_generation` (a pause holds every later /generate until a resume)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("schemathesis")

TOKEN = "engine-openapi-token"
EXAMPLES_PER_OPERATION = 30
EXCLUDED = ["/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
            "/update_weights_from_distributed", "/pause_generation"]  # fmt: skip


@pytest.fixture(scope="module")
def engine_url(tiny):
    cmd = [sys.executable, "-m", "agentrl.cli", "serve-engine", "--model", str(tiny), "--port", "0",
           "--max-seq-len", "64", "--max-batch-size", "4", "--threads", "1"]  # fmt: skip
    env = {**os.environ, "AGENTRL_ENGINE_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in proc.stdout:
            match = re.search(r"serving (http://\S+)", line)
            if match:
                yield match.group(1)
                break
        else:
            raise AssertionError("serve-engine did not start")
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def get(url, token=None):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_openapi_states_the_engines_rules(engine_url, tok):
    status, _, spec = get(engine_url + "/openapi.json")  # open: no token needed
    assert status == 200
    schemas = spec["components"]["schemas"]
    gen = schemas["GenerateRequest"]
    assert gen["required"] == ["input_ids"] and gen["additionalProperties"] is False
    assert gen["properties"]["input_ids"]["items"]["maximum"] == len(tok) - 1
    assert gen["properties"]["input_ids"]["maxItems"] == 63
    assert schemas["WireSamplingParams"]["properties"]["top_p"] == {
        "type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0
    }  # fmt: skip
    assert "top_logprobs_num" in gen["properties"]
    status, headers, body = get(engine_url + "/generate", TOKEN)
    assert (status, headers["Allow"], body["error"]["field"]) == (405, "POST", "method")


def test_schemathesis_finds_no_failure(engine_url, tmp_path):
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{engine_url}/openapi.json", "--checks", "all",
           "--header", f"Authorization: Bearer {TOKEN}", "--max-examples", str(EXAMPLES_PER_OPERATION),
           "--seed", "1", "--workers", "1", *[f"--exclude-path={p}" for p in EXCLUDED]]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode == 0 and "No issues found" in report, report[-6000:]
    tested = re.search(r"(\d+) generated, (\d+) passed", report)
    assert tested and int(tested.group(1)) >= EXAMPLES_PER_OPERATION, report[-2000:]
