"""Serve the OpenAI proxy in front of one embedded engine on a tiny model (a subprocess for the suite).

`python proxy_main.py MODEL_DIR [TOKEN [READ_TIMEOUT_S]]` prints `proxy serving http://127.0.0.1:PORT` once it accepts
requests; trajectories of closed sessions are kept in memory (count on `/health`).
"""

from __future__ import annotations

import asyncio
import sys


async def main(model_dir: str, token: str, read_timeout_s: float) -> None:
    import torch

    from agentrl.engines.base import SamplingParams
    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.proxy.server import OpenAIProxy
    from agentrl.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    engine = EmbeddedEngine(model_dir, max_batch_size=8, max_seq_len=256)
    sunk: list = []
    proxy = OpenAIProxy([engine], load_tokenizer(model_dir), sink=sunk.extend, max_seq_len=256,
                        sampling=SamplingParams(max_new_tokens=4), token=token,
                        read_timeout_s=read_timeout_s)  # fmt: skip
    url = await proxy.start("127.0.0.1", 0)
    print(f"proxy serving {url}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    model, token, timeout_s = (sys.argv[1:] + ["", "30"][len(sys.argv) - 2 :])[:3]
    asyncio.run(main(model, token, float(timeout_s)))
