"""Coding-agent CLIs, unchanged, through the recording proxy: Claude Code (the Anthropic face) and Codex CLI (the
Responses API) each run one tool loop against a scripted engine: the model asks for a shell command, the CLI
runs it, the model answers with what it printed. Each episode must close into one trajectory, token-exact: one
segment, the model's tokens (and only they) trained, the command's real output among the loss-masked tokens.

    npm i -g @anthropic-ai/claude-code @openai/codex          # or npm i --prefix DIR ...; then --bin DIR/node_modules/.bin
    python examples/agents/coding_clis.py [--only claude|codex] [--bin DIR]

No traffic leaves loopback: where `unshare` can make a network namespace (Linux, user namespaces), the script
re-runs itself inside one that has only `lo` (`--no-isolate` skips that), and the CLIs are told to send no
telemetry (docs/agents.md lists the variables). The engine is scripted, so the run needs no model: the
tokenizer and chat template are the tiny model's (agentrl.engines.tiny). It prints one line per CLI and exits
non-zero when one fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from agentrl.chat import chat_tokens
from agentrl.engines.base import Engine, GenerateOutput, SamplingParams
from agentrl.engines.tiny import make_tiny_model
from agentrl.proxy.server import OpenAIProxy
from agentrl.tokenizer import load_tokenizer
from agentrl.types import mask, tokens

COMMAND = "echo agentrl-$((6*7))"  # the shell computes 42: the answer can only quote it if the CLI ran it
PRINTED = "agentrl-42"
TASK = f"Run the shell command `{COMMAND}` and tell me what it printed."
MODEL = "agentrl"
ISOLATED = "AGENTRL_LOOPBACK_ONLY"  # set inside the network namespace the script re-runs itself in
# the environment each CLI needs besides its base URL and key (docs/agents.md explains each)
QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CODEX_DISABLE_UPDATE_CHECK": "1"}  # fmt: skip


class ScriptedEngine(Engine):
    """The policy, scripted: a shell call first (named as the CLI's tool list names it), then, once the input
    holds the tool's output, an answer quoting it. Each reply ends with the chat's end-of-turn token."""

    def __init__(self, tokenizer: Any):
        self.chat = chat_tokens(tokenizer)
        self.calls: list[str] = []

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None
                       ) -> GenerateOutput:  # fmt: skip
        text = self.chat.decode(input_ids)
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
        if results:
            reply = f"The command printed {results[-1].strip()}."
        else:
            # the CLI's shell tool: Claude Code's `Bash` {command}, Codex's `exec_command` {cmd}
            tool, arguments = (
                ("Bash", {"command": COMMAND})
                if '"name": "Bash"' in text
                else ("exec_command", {"cmd": COMMAND})
            )
            reply = f"<tool_call>\n{json.dumps({'name': tool, 'arguments': arguments})}\n</tool_call>"
        self.calls.append(reply)
        ids = [*self.chat.encode(reply), self.chat.eot_id][: sampling.max_new_tokens]
        return GenerateOutput(output_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop",
                              versions=[(0, len(ids))], prompt_tokens=len(input_ids))  # fmt: skip

    async def abort(self, request_id: str) -> None:
        pass

    async def pause(self, mode: Any = "keep") -> None:
        pass

    async def resume(self) -> None:
        pass

    async def update_weights(self, version: int, source: Any) -> None:
        raise NotImplementedError("a scripted engine has no weights")

    async def flush_cache(self) -> None:
        pass

    async def health(self) -> dict[str, Any]:
        return {"ok": True}

    async def close(self) -> None:
        pass


def claude_command(
    binary: str, base_url: str, home: Path, lean: bool, token: str
) -> tuple[list[str], dict[str, str]]:
    # with a proxy token: ANTHROPIC_AUTH_TOKEN, sent as `Authorization: Bearer` (the proxy's check)
    key = {"ANTHROPIC_AUTH_TOKEN": token} if token else {"ANTHROPIC_API_KEY": "unused"}
    env = {"ANTHROPIC_BASE_URL": base_url, **key, "ANTHROPIC_MODEL": MODEL, **QUIET}
    # -p: one task, no terminal UI; --allowedTools Bash: the command runs without asking
    argv = [binary, "-p", TASK, "--allowedTools", "Bash", "--model", MODEL, "--max-turns", "4"]
    if (
        lean
    ):  # no hooks, plugins or memory, only the Bash tool, a short system prompt (the default is ~20k tokens)
        argv += [
            "--bare",
            "--tools",
            "Bash",
            "--system-prompt",
            "You are a coding agent. Run commands with Bash.",
        ]
    return argv, env


def codex_command(
    binary: str, base_url: str, home: Path, lean: bool, token: str
) -> tuple[list[str], dict[str, str]]:
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    # web search (a hosted tool) and the multi-agent tools (a `namespace` tool) off: the proxy serves function tools
    (home / ".codex" / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "agentrl"\nweb_search = "disabled"\n\n[agents]\nenabled = false\n\n'
        f'[model_providers.agentrl]\nname = "agentrl proxy"\nbase_url = "{base_url}"\n'
        'env_key = "AGENTRL_PROXY_KEY"\nwire_api = "responses"\n'
    )
    env = {"CODEX_HOME": str(home / ".codex"), "AGENTRL_PROXY_KEY": token or "unused", **QUIET}
    argv = [binary, "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access", TASK]
    return argv, env


async def episode(
    name: str, binary: str, tok: Any, workdir: Path, lean: bool, token: str
) -> tuple[bool, str]:
    engine = ScriptedEngine(tok)
    trajectories: list[Any] = []
    proxy = OpenAIProxy([engine], tok, sink=trajectories.extend, sampling=SamplingParams(max_new_tokens=512),
                        max_seq_len=65536, model_name=MODEL, sampling_policy="override", token=token)  # fmt: skip
    url = await proxy.start("127.0.0.1")
    sid = f"{name}-episode"
    home = workdir / name
    home.mkdir(parents=True, exist_ok=True)
    argv, env = (claude_command if name == "claude" else codex_command)(
        binary, f"{url}/v1/sessions/{sid}", home, lean, token
    )
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=home, env={"PATH": os.environ["PATH"], "HOME": str(home), **env},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
        output = out.decode(errors="replace")
        reward_url = f"{url}/v1/sessions/{sid}/reward"
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        async with (
            aiohttp.ClientSession(headers=auth) as http,
            http.post(reward_url, json={"reward": 1.0}) as resp,
        ):
            closed = await resp.text()
    finally:
        await proxy.stop()
    return check(name, tok, engine, trajectories, output, proc.returncode, closed)


def check(name: str, tok: Any, engine: ScriptedEngine, trajectories: list[Any], output: str, rc: int | None,
          closed: str) -> tuple[bool, str]:  # fmt: skip
    """One trajectory of one segment whose trained tokens are exactly the scripted replies, with the shell's
    output in the loss-masked part, and the CLI's answer quoting it."""
    chat = chat_tokens(tok)
    problems = []
    if rc != 0 or PRINTED not in output:
        problems.append(f"the CLI exited {rc} without printing {PRINTED}: {output[-2000:]}")
    if len(trajectories) != 1:
        problems.append(f"{len(trajectories)} trajectories ({closed})")
    else:
        (traj,) = trajectories
        response, trained = tokens(traj.response_ids).tolist(), mask(traj).tolist()
        model = [t for t, m in zip(response, trained, strict=True) if m]
        given = chat.decode([t for t, m in zip(response, trained, strict=True) if not m])
        expected = [t for reply in engine.calls for t in [*chat.encode(reply), chat.eot_id]]
        if traj.metadata["segments"] != 1 or model != expected:
            problems.append(f"not one token-exact segment: {traj.metadata} {chat.decode(model)!r}")
        if PRINTED not in given:
            problems.append(f"the tool's output is not among the loss-masked tokens: {given!r}")
    answer = output.strip().splitlines()[-1] if output.strip() else ""
    verdict = "ok" if not problems else "FAILED"
    prompt = len(tokens(trajectories[0].prompt_ids)) if trajectories else 0
    line = (f"{name}: {verdict}: {len(engine.calls)} model turns, {len(trajectories)} trajectory "
            f"({prompt} prompt tokens); it said {answer!r}")  # fmt: skip
    return not problems, line + "".join(f"\n  {p}" for p in problems)


def isolated(argv: list[str]) -> list[str] | None:
    """This command again, inside a network namespace that has only loopback, where unshare can make one."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    inner = " ".join(f"'{a}'" for a in [sys.executable, *argv, "--no-isolate"])
    return ["unshare", "-rn", "sh", "-c", f"ip link set lo up && {ISOLATED}=1 exec {inner}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["claude", "codex"], action="append")
    parser.add_argument(
        "--bin", default="", help="directory of the `claude` and `codex` executables (else PATH)"
    )
    parser.add_argument("--no-isolate", action="store_true", help="run in this network namespace")
    parser.add_argument(
        "--lean", action="store_true", help="Claude Code with --bare, only Bash, a short prompt"
    )
    parser.add_argument("--token", default="", help="a bearer token the proxy requires (the CLIs send it)")
    args = parser.parse_args()
    if not args.no_isolate:
        command = isolated(sys.argv)
        if command is not None:
            return subprocess.run(command).returncode
        print("coding_clis: no network namespace (unshare): relying on the CLIs' no-telemetry settings")
    else:
        print(
            "coding_clis: network: loopback only"
            if os.environ.get(ISOLATED)
            else "coding_clis: network: host's"
        )
    binaries = {name: shutil.which(name, path=args.bin or None) for name in args.only or ["claude", "codex"]}
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer(make_tiny_model(Path(tmp) / "model", hidden=32, layers=1, heads=2, kv_heads=1))
        ok = True
        for name, binary in binaries.items():
            if binary is None:
                print(
                    f"{name}: not found (npm i -g {'@anthropic-ai/claude-code' if name == 'claude' else '@openai/codex'})"
                )
                ok = False
                continue
            passed, line = asyncio.run(episode(name, binary, tok, Path(tmp), args.lean, args.token))
            print(line, flush=True)
            ok = ok and passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
