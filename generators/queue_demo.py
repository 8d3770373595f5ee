"""Submits demonstration trajectories (token-form groups, one chat-form episode) through the queue's front door.

    agentrl make-tiny-model runs/tiny-model            # any HF model dir with a chat template works
    echo secret > token; AGENTRL_QUEUE_TOKEN=secret agentrl serve-queue --port 8765 --model runs/tiny-model &
    agentrl generate queue_demo --queue http://127.0.0.1:8765 --token-file token [-- --groups 2 --group-size 4]

Token form: the agent sends the token ids it sampled (and the behaviour log-probs and the policy version, when
it knows them), as lists or numpy arrays (the client sends an array with its dtype). Chat form: the agent sends
`messages` + reward; the server tokenizes them with the run's chat template and trains only on assistant turns
(the server needs --model for that, else it answers 422). A template for a generator of your own: make the
trajectories of your task, then `ctx.client().submit(...)`.
"""

from __future__ import annotations

import argparse
import random
import uuid

import numpy as np

from agentrl.queue.client import SubmitError

TASK = "external_demo"


def token_form_group(n: int, rng: random.Random) -> list[dict]:
    """n samples of one prompt (one GRPO group); ids are idempotency keys, so resubmitting is harmless."""
    group = f"prompt-{uuid.uuid4().hex[:8]}"
    prompt = [rng.randrange(3, 300) for _ in range(12)]
    out = []
    for k in range(n):
        response = [rng.randrange(3, 300) for _ in range(rng.randint(4, 16))]
        out.append({
            "id": f"{group}-{k}",
            "group_id": group,
            "env": "external_demo",
            "prompt_ids": prompt,  # a plain list of ints, or a numpy array of any integer dtype
            "response_ids": np.asarray(response, dtype=np.int64),
            "logprobs": np.asarray([-rng.random() for _ in response], dtype=np.float32),
            "policy_version": 0,
            "reward": float(rng.random() > 0.5),
            "metadata": {"agent": "queue_demo"},
        })  # fmt: skip
    return out


def chat_form(rng: random.Random) -> dict:
    guess = rng.randint(1, 100)
    return {
        "id": f"chat-{uuid.uuid4().hex[:8]}",
        "env": "external_demo",
        "messages": [
            {"role": "system", "content": "Guess the number between 1 and 100."},
            {"role": "user", "content": "Your guess?"},
            {"role": "assistant", "content": f"My guess: {guess}"},
            {"role": "user", "content": "lower" if guess > 50 else "higher"},
            {"role": "assistant", "content": f"My guess: {guess // 2 + 25}"},
        ],
        "reward": 1.0,
    }


def main(ctx) -> None:
    parser = argparse.ArgumentParser(prog="agentrl generate queue_demo --")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(ctx.argv)
    rng = random.Random(args.seed)
    with ctx.client() as client:
        for _ in range(args.groups):
            print("token form:", client.submit(token_form_group(args.group_size, rng)))
        try:
            print("chat form: ", client.submit(chat_form(rng)))
        except SubmitError as exc:
            print(f"chat form refused: {exc}")
        status = client.status()
        print(
            f"queue depth {status['depth']}, policy version {status['policy_version']}, counts {status['counts']}"
        )
