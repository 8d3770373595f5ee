"""Serve the embedded engine over HTTP with SGLang's routes (`agentrl serve-engine --model DIR`).

Prints one line `agentrl serve-engine: serving http://HOST:PORT` once it accepts requests (with --port 0 the
chosen port is in it), then serves until interrupted.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", "--model-path", dest="model", required=True, help="Hugging Face model directory"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--max-batch-size", type=int, default=64, help="KV-cache slots (concurrent requests)")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens per request")
    parser.add_argument("--max-prefill-tokens", type=int, default=8192)
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=0,
        help="decode steps per scheduler iteration (0: 8 on CUDA, 1 on CPU)",
    )
    parser.add_argument(
        "--sampler",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="auto: one fused Triton kernel per step on CUDA (no top-p/top-k), torch ops otherwise",
    )
    parser.add_argument("--weight-version", type=int, default=0, help="policy version of the loaded weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="bearer token clients must send (or $AGENTRL_ENGINE_TOKEN); required off loopback",
    )
    parser.add_argument("--max-body-bytes", type=int, default=64 << 20, help="request body cap (not weights)")
    parser.add_argument(
        "--read-timeout-s", type=float, default=30.0, help="time a client has to send a request"
    )


async def _serve(args: argparse.Namespace) -> None:
    import asyncio

    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.engines.server import EngineServer

    engine = EmbeddedEngine(
        args.model, device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len, max_prefill_tokens=args.max_prefill_tokens,
        policy_version=args.weight_version, seed=args.seed, decode_steps=args.decode_steps,
        sampler=args.sampler,
    )  # fmt: skip
    import os

    from agentrl.engines.server import TOKEN_ENV

    token = args.api_key if args.api_key is not None else os.environ.get(TOKEN_ENV, "")
    server = EngineServer(engine, args.host, args.port, token=token, max_body_bytes=args.max_body_bytes,
                          read_timeout_s=args.read_timeout_s)  # fmt: skip
    url = await server.start()
    print(f"agentrl serve-engine: serving {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop(close_engine=True)


def main(args: argparse.Namespace) -> int:
    import asyncio

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(_serve(args))
    return 0


if __name__ == "__main__":  # `python -m agentrl.engines.cli --model DIR` (what tests and launchers spawn)
    import sys

    _parser = argparse.ArgumentParser(prog="agentrl serve-engine")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
