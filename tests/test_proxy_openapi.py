"""The proxy's `/openapi.json` states what it enforces on its three faces (OpenAI chat, OpenAI Responses,
Anthropic Messages): checked by hand for the parameter rules, then by Schemathesis (all its checks) against a
live proxy over loopback on the tiny model (embedded engine). The
rules beyond JSON Schema (tokens, cross-field, header-or-field) are stated in descriptions and honoured by
the generated positive requests through tests/proxy_schemathesis_hooks.py."""

from __future__ import annotations

import asyncio
import os
import re
import sys

import aiohttp
import pytest

from agentrl.engines.base import SamplingParams
from agentrl.proxy.server import OpenAIProxy
from tests.gen_support import embedded_engine

# the repo root, on the schemathesis process's PYTHONPATH: its hooks are tests.proxy_schemathesis_hooks
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("schemathesis")

TOKEN = "proxy-openapi-token"
# every operation gets all checks at this count too: 25 made 510 requests (~30 s of fuzzing on 2 cores), 10 make 216
EXAMPLES_PER_OPERATION = 10
# Schemathesis's coverage phase enumerates boundary and negative variants of every field of every content-part
# kind, regardless of --max-examples: with the picture parts of the chat, Responses and Messages faces it made
# ~12,000 requests (over 400 s on 2 cores). The bounds it found (max_tokens, seed) are asserted directly in the
# test above; the examples, fuzzing and stateful phases run here with the default checks.
PHASES = "examples,fuzzing,stateful"


async def test_openapi_states_the_parameter_rules_and_405(tiny, tok):
    proxy = OpenAIProxy([embedded_engine(tiny)], tok, sampling=SamplingParams(temperature=0.8), token=TOKEN)
    url = await proxy.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/openapi.json") as resp:  # open: no token needed
                spec = await resp.json()
            async with http.get(
                url + "/v1/sessions/s/chat/completions", headers={"Authorization": f"Bearer {TOKEN}"}
            ) as resp:
                assert (resp.status, resp.headers["Allow"]) == (405, "POST")
                assert (await resp.json())["error"]["param"] == "method"
            auth = {"Authorization": f"Bearer {TOKEN}"}
            # numbers past int64 are refused by name, as the schema says
            hi = [{"role": "user", "content": "hi"}]
            async with http.post(url + "/v1/sessions/s/chat/completions", headers=auth,
                                 json={"messages": hi, "seed": 2**63}) as resp:  # fmt: skip
                assert (resp.status, (await resp.json())["error"]["param"]) == (400, "seed")
            async with http.post(url + "/v1/sessions/s/v1/messages", headers=auth,
                                 json={"messages": hi, "max_tokens": 2**63}) as resp:  # fmt: skip
                assert resp.status == 400 and (await resp.json())["error"]["message"].startswith("max_tokens")
        props = spec["components"]["schemas"]["ChatRequest"]["properties"]
        assert props["temperature"]["anyOf"][0] == {"const": 0.8}  # the run's: others are refused
        assert props["presence_penalty"]["anyOf"][0] == {"const": 0}
        assert props["top_logprobs"]["anyOf"][0]["maximum"] == 20
        assert props["seed"]["anyOf"][0]["maximum"] == props["max_tokens"]["anyOf"][0]["maximum"] == 2**63 - 1
        assert spec["components"]["schemas"]["ChatRequest"]["additionalProperties"] is False
        assert "/v1/sessions/{sid}/models" in spec["paths"]
        # the Responses and Anthropic faces, their bodies from their request Structs with the server's rules
        body = {path: op["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                for path, op in spec["paths"].items() if "post" in op and "requestBody" in op["post"]}  # fmt: skip
        assert {p: body[p] for p in body if "responses" in p or "messages" in p} == {
            "/v1/sessions/{sid}/responses": "ResponsesRequest", "/v1/responses": "ResponsesRequest",
            "/v1/sessions/{sid}/v1/messages": "MessagesRequest", "/v1/messages": "MessagesRequest",
            "/v1/sessions/{sid}/v1/messages/count_tokens": "CountRequest", "/v1/messages/count_tokens": "CountRequest",
        }  # fmt: skip
        schemas = spec["components"]["schemas"]
        responses = schemas["ResponsesRequest"]["properties"]
        assert responses["temperature"]["anyOf"][0] == {"const": 0.8}
        assert responses["truncation"]["enum"] == ["disabled", None]
        assert responses["tools"]["anyOf"][0]["items"]["properties"]["type"] == {"const": "function"}
        assert schemas["ResponsesRequest"]["additionalProperties"] is False
        kinds = [
            item["properties"]["type"]["const"] for item in responses["input"]["anyOf"][1]["items"]["anyOf"]
        ]
        assert kinds == ["message", "function_call", "function_call_output"]  # no reasoning channel: refused
        messages = schemas["MessagesRequest"]["properties"]
        assert messages["temperature"]["anyOf"][0] == {"const": 0.8}
        assert messages["top_k"]["type"] == "null"
        assert "max_tokens" in schemas["MessagesRequest"]["required"]
        assert (messages["max_tokens"]["minimum"], messages["max_tokens"]["maximum"]) == (1, 2**63 - 1)
        assert schemas["ToolChoice"]["properties"]["type"]["enum"] == ["auto", "any", "tool", "none"]
        assert "max_tokens" not in schemas["CountRequest"]["properties"]
        error = spec["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"][
            "schema"
        ]
        assert error == {"$ref": "#/components/schemas/AnthropicError"}
    finally:
        await proxy.stop()
        await proxy.engines[0].close()


async def test_schemathesis_finds_no_failure(tiny, tok, tmp_path):
    proxy = OpenAIProxy([embedded_engine(tiny, max_seq_len=2048)], tok, sampling=SamplingParams(max_new_tokens=8),
                        max_seq_len=2048, token=TOKEN)  # fmt: skip
    url = await proxy.start()
    try:
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all",
               "--header", f"Authorization: Bearer {TOKEN}",
               "--max-examples", str(EXAMPLES_PER_OPERATION), "--seed", "1", "--workers", "1", "--phases", PHASES]  # fmt: skip
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.proxy_schemathesis_hooks",
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 400)
        report = out.decode()
        tested = re.search(r"(\d+) generated, (\d+) passed", report)  # warnings (404s on random ids) allowed
        assert proc.returncode == 0 and tested and tested.group(1) == tested.group(2), report[-8000:]
        assert int(tested.group(1)) >= EXAMPLES_PER_OPERATION, report[-2000:]
    finally:
        await proxy.stop()
        await proxy.engines[0].close()
