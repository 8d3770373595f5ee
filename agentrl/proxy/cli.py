"""Serve the OpenAI-compatible proxy on its own (`agentrl serve-proxy --engine URL --model DIR --sink ...`).

The proxy (agentrl/proxy/server.py) in front of running engines, reached by URL: `agentrl serve-engine`
or SGLang servers (several `--engine`: each session goes to the engine with the fewest requests in flight
and keeps its turns there). Closed sessions (`POST /v1/sessions/<id>/reward`) become trajectories for the
sink: a serve-queue URL (`http://...`, token from `--sink-token` or $AGENTRL_QUEUE_TOKEN) or a JSONL file
(one trajectory a line, arrays as lists: the JSON form `POST /v1/trajectories` takes). The tokenizer and
chat template come from `--model`. Prints one line `agentrl serve-proxy: serving http://HOST:PORT` once it
accepts requests (agents use `base_url = http://HOST:PORT/v1/sessions/<session id>`), then serves until
interrupted. Tokens: `--token` or $AGENTRL_PROXY_TOKEN (required off loopback), never printed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

TOKEN_ENV = "AGENTRL_PROXY_TOKEN"


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")) or len(value.split("://", 1)[1].strip("/")) == 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s):// URL")
    return value.rstrip("/")


def _positive(kind: type) -> Any:
    def check(value: str) -> Any:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a {kind.__name__}") from None
        if number <= 0:
            raise argparse.ArgumentTypeError(f"{value!r} must be > 0")
        return number

    return check


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not in [0, 65535]")
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", type=_url, action="append", required=True, metavar="URL",
                        help="an engine server (serve-engine or SGLang); repeat for several")  # fmt: skip
    parser.add_argument(
        "--engine-token", default=None, help="engines' bearer token (or $AGENTRL_ENGINE_TOKEN)"
    )
    parser.add_argument("--model", "--model-path", dest="model", required=True,
                        help="Hugging Face directory of the served model (tokenizer and chat template)")  # fmt: skip
    parser.add_argument("--sink", required=True, metavar="URL|PATH",
                        help="where closed sessions go: a serve-queue URL, or a JSONL file to append to")  # fmt: skip
    parser.add_argument(
        "--sink-token", default=None, help="serve-queue's bearer token (or $AGENTRL_QUEUE_TOKEN)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000, help="0 picks a free port")
    parser.add_argument("--token", default=None, help=f"bearer token clients must send (or ${TOKEN_ENV})")
    parser.add_argument(
        "--max-seq-len", type=_positive(int), default=2048, help="prompt + reply tokens a session may hold"
    )
    parser.add_argument(
        "--max-new-tokens", type=_positive(int), default=256, help="reply tokens when a request names none"
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="the sampling the trajectories are trained as"
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--proxy-sampling", choices=["refuse", "record", "override"], default="refuse",
                        help="a request's temperature/top_p other than the run's: refused (400), sampled with "
                        "and recorded (record), or replaced by the run's and recorded as asked (override)")  # fmt: skip
    parser.add_argument(
        "--tool-parser", default="", help="hermes or qwen3_coder ('' picks by the chat template)"
    )
    parser.add_argument("--model-name", default="agentrl", help="the model id /v1/models lists")
    parser.add_argument("--env-name", default="openai_proxy", help="the `env` recorded in each trajectory")
    parser.add_argument("--session-timeout-s", type=_positive(float), default=3600.0,
                        help="an idle session is dropped after this long")  # fmt: skip
    parser.add_argument("--request-timeout-s", type=_positive(float), default=300.0,
                        help="most seconds one engine request may take")  # fmt: skip
    parser.add_argument("--keep-side-requests", action="store_true",
                        help="send side requests (title / summary calls) to the sink as their own trajectories, "
                        "flagged metadata.side_request, rather than drop them")  # fmt: skip


def _jsonl_sink(path: Path) -> Any:
    import msgspec
    import numpy as np

    from agentrl.types import BARE_DTYPES

    def write(trajectories: list) -> None:
        lines = []
        for traj in trajectories:
            row = msgspec.to_builtins(traj)
            for name, dtype in BARE_DTYPES.items():
                value = getattr(traj, name)
                if type(value) is bytes:
                    row[name] = np.frombuffer(value, dtype=dtype).tolist()
            lines.append(msgspec.json.encode(row) + b"\n")
        with open(path, "ab") as out:  # one write per reward: whole lines, in order
            out.write(b"".join(lines))

    return write


def _queue_sink(url: str, token: str) -> tuple[Any, Any]:
    from agentrl.errors import QueueFull
    from agentrl.proxy.openai_params import RequestError
    from agentrl.queue.client import AsyncQueueClient, SubmitError

    client = AsyncQueueClient(url, token, timeout_s=30.0)

    async def submit(trajectories: list) -> None:
        try:
            await client.submit(trajectories)
        except SubmitError as exc:  # the session stays open: the agent may post its reward again
            if exc.status == 429:
                raise QueueFull(f"{url}: {exc.message}") from None
            raise RequestError(502, f"the queue at {url} refused the trajectories: {exc}") from None

    return submit, client


def check(args: argparse.Namespace) -> None:
    """Refusals that argparse cannot make, each naming its flag (ConfigError)."""
    from agentrl.errors import ConfigError
    from agentrl.net import is_loopback

    if not (Path(args.model) / "tokenizer_config.json").exists():
        raise ConfigError(f"--model {args.model}: no tokenizer_config.json (a Hugging Face model directory?)")
    if not args.sink.startswith(("http://", "https://")):
        parent = Path(args.sink).resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"--sink {args.sink}: directory {parent} does not exist")
        if Path(args.sink).is_dir():
            raise ConfigError(f"--sink {args.sink}: is a directory, not a JSONL file")
    if not args.token and not is_loopback(args.host):
        raise ConfigError(f"--host {args.host} is not loopback: set --token (or ${TOKEN_ENV})")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: must be >= 0")


async def _serve(args: argparse.Namespace) -> None:
    import asyncio

    from agentrl.engines.base import SamplingParams
    from agentrl.engines.sglang import SGLangEngine
    from agentrl.errors import ConfigError
    from agentrl.proxy.server import OpenAIProxy
    from agentrl.proxy.tool_parsers import parser_for
    from agentrl.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    try:
        parser_for(args.tool_parser, getattr(tokenizer, "chat_template", None))
    except ConfigError as exc:
        raise ConfigError(f"--tool-parser {args.tool_parser}: {exc}") from None
    engines = [SGLangEngine(url, request_timeout_s=args.request_timeout_s, api_key=args.engine_token)
               for url in args.engine]  # fmt: skip
    for engine in engines:
        health = await engine.health()
        if not health["ok"]:
            raise ConfigError(f"--engine {engine.url}: not answering ({health['error']})")
        await engine.text_options()  # stop strings and structured output, as /openapi.json says
    client = None
    if args.sink.startswith(("http://", "https://")):
        sink, client = _queue_sink(args.sink.rstrip("/"), args.sink_token or "")
    else:
        sink = _jsonl_sink(Path(args.sink))
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, stop_token_ids=stop)  # fmt: skip
    proxy = OpenAIProxy(engines, tokenizer, sink, sampling=sampling, max_seq_len=args.max_seq_len,
                        model_name=args.model_name, env_name=args.env_name, session_timeout_s=args.session_timeout_s,
                        token=args.token, tool_parser=args.tool_parser, sampling_policy=args.proxy_sampling,
                        keep_side_requests=args.keep_side_requests)  # fmt: skip
    url = await proxy.start(args.host, args.port)
    print(f"agentrl serve-proxy: serving {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await proxy.stop()
        if client is not None:
            await client.close()
        for engine in engines:
            await engine.close()


def main(args: argparse.Namespace) -> int:
    import asyncio

    if args.token is None:
        args.token = os.environ.get(TOKEN_ENV, "")
    if args.sink_token is None:
        args.sink_token = os.environ.get("AGENTRL_QUEUE_TOKEN", "")
    check(args)
    asyncio.run(_serve(args))
    return 0
