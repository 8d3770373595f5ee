"""Plays a live run's parked tasks (rollout.generator = "external") over HTTP; the env scores each reply.

    agentrl run examples/agents/external.toml &                  # prints "external agents: GET <url>/..."
    agentrl generate external_http_agent --run-dir runs/external
    python generators/external_http_agent.py --run-dir runs/external     # the same, without agentrl

It claims a task, chats through the task's OpenAI base URL, and lets the env score each reply
(`POST /v1/tasks/<id>/step`), until the run ends. Plain HTTP (requests) and no agentrl import, so the same loop
can be written in any language. Its own arguments (after `--` under `agentrl generate`): `--url` (a task
server, instead of the run's proxy.json), `--token` (rollout.proxy_token; else $AGENTRL_PROXY_TOKEN),
`--episodes N` (stop after N; 0: until the run ends) and `--abandon K` (walk away from the first K tasks after
one reply: they end as `aborted` after `rollout.external_timeout_s`; what the tests use to check that path).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import requests

TASK = "*"  # any env: the run's env scores the replies


def task_server(run_dir: Path, wait_s: float) -> str:
    """The first task server named in the run's proxy.json (written once the run dispatches its first task)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            servers = json.loads((run_dir / "proxy.json").read_text()).get("task_servers", {})
        except (FileNotFoundError, ValueError):
            servers = {}
        if servers:
            return next(iter(servers.values()))
        time.sleep(0.2)
    raise SystemExit(f"no task server in {run_dir / 'proxy.json'} after {wait_s:.0f}s")


def play(http: requests.Session, url: str, task: dict, abandon: bool) -> str:
    """One episode: chat, hand each reply to the env, stop when it says done. Returns how it ended."""
    messages = task["messages"]
    for _ in range(task["max_turns"]):
        resp = http.post(
            f"{task['base_url']}/chat/completions", json={"model": "agentrl", "messages": messages}
        )
        resp.raise_for_status()
        text = resp.json()["choices"][0]["message"]["content"] or ""
        if abandon:
            return "abandoned"
        step = http.post(f"{url}/v1/tasks/{task['task_id']}/step", json={"action": text})
        step.raise_for_status()
        result = step.json()
        if result["done"]:
            return f"reward {result['info'].get('episode_reward', result['reward'])}"
        messages = [*messages, {"role": "assistant", "content": text}, *result["messages"]]
    return "out of turns"


def arguments(run_dir: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=run_dir)
    if run_dir:
        where.add_argument("--run-dir", type=Path, help="the run's directory (reads proxy.json)")
    where.add_argument("--url", help="a task server URL")
    parser.add_argument(
        "--token", default=os.environ.get("AGENTRL_PROXY_TOKEN", ""), help="rollout.proxy_token"
    )
    parser.add_argument("--abandon", type=int, default=0, help="walk away from the first K tasks")
    parser.add_argument(
        "--episodes", type=int, default=0, help="stop after this many (0: until the run ends)"
    )
    return parser


def main(ctx) -> None:
    """`agentrl generate external_http_agent --run-dir DIR [-- --abandon K ...]`."""
    args = arguments(run_dir=False).parse_args(ctx.argv)
    if args.url is None and ctx.run_dir is None:
        raise SystemExit("external_http_agent: give --run-dir (a live run) or, after --, --url TASK_SERVER")
    play_tasks(ctx.run_dir, args)


def play_tasks(run_dir: Path | None, args: argparse.Namespace) -> None:
    url = args.url or task_server(run_dir, 120.0)
    http = requests.Session()
    if args.token:
        http.headers["Authorization"] = f"Bearer {args.token}"
    played = 0
    while not args.episodes or played < args.episodes:
        try:
            resp = http.get(f"{url}/v1/tasks/next", params={"wait_s": 5}, timeout=30)
        except requests.ConnectionError:  # the run has ended (its workers are gone)
            break
        if run_dir is not None and (run_dir / "summary.json").exists():
            break
        if resp.status_code == 204:
            continue
        resp.raise_for_status()
        task = resp.json()
        try:
            outcome = play(http, url, task, played < args.abandon)
        except requests.RequestException as exc:  # e.g. the run stopped mid-episode
            outcome = f"error {exc}"
        print(f"{task['task_id']}: {outcome}", flush=True)
        played += 1


if __name__ == "__main__":
    standalone = arguments(run_dir=True).parse_args()
    play_tasks(standalone.run_dir, standalone)
