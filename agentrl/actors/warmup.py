"""Supervised warm-up (`[warmup]`): a few SFT steps on the env's demonstrations before RL.

Demonstrations are tokenized exactly as a multi-turn rollout of the same conversation would be
(agentrl.chat.demonstration_images; pictures stored once and placed, as a rollout records them): loss on assistant
tokens and their end-of-turn, none on env/tool tokens. It runs `warmup.steps` steps, or fewer: `warmup.stop_loss`
ends it once the loss is low enough, so that where it ends is a state of the model (how well it imitates the
demonstrations), not a step count (the same step count leaves different states on machines whose vector width
changes the floating-point order). Tasks come from `warmup.seed` (agentrl.data.warmup_source): env tasks from a seed range apart from
training and evaluation, or, with `data.path`, the dataset's rows in a `warmup.seed` order. Afterwards the optimizer's
first moment is zeroed and its second kept (`reset_optimizer`, agentrl.learners.base.forget_momentum): Adam
would otherwise coast on the SFT momentum through every RL step whose advantages are all zero (measured: a
warmed-up calculator_tools model went from 34% to 100% malformed tool calls in 8 such steps), and fresh second
moments would make the first RL updates sign steps of the full lr (measured: greedy eval 0.71 -> 0.17 in 10
steps). Runs inside the
learner's process (LearnerWorker.warmup); the policy version is left unchanged (v0 is the warmed-up model).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from agentrl.chat import demonstration_images
from agentrl.config import Config
from agentrl.errors import EnvError
from agentrl.types import Trajectory, image, message_images, pack_tokens

STOP_WINDOW = 5  # warmup.stop_loss compares the mean loss of this many last steps


def demonstration_batch(
    cfg: Config, env: Any, tokenizer: Any, tasks: list[dict[str, Any]], tag: str
) -> list[Trajectory]:
    trajs = []
    for i, task in enumerate(tasks):
        try:
            messages = env.demonstration(task)
        except NotImplementedError:
            raise EnvError(
                f"warmup.steps > 0 needs demonstrations, and env '{cfg.env.name}' has none"
            ) from None
        # an env whose demonstrations are tool calls names its tools (`env.tools`): they go in the prompt
        prompt, response, mask, spans = demonstration_images(tokenizer, messages, getattr(env, "tools", None))
        pictures = {img.sha256: img for img in map(image, message_images(messages))}  # each stored once
        trajs.append(
            Trajectory(
                id=f"demo-{tag}-{i}",
                prompt_ids=pack_tokens(prompt),
                response_ids=pack_tokens(response),
                loss_mask=np.asarray(mask, dtype=np.uint8).tobytes(),
                images=list(pictures.values()) or None,
                image_spans=spans or None,
            )
        )
    return trajs


def run_warmup(cfg: Config, learner: Any, tokenizer: Any, pad_id: int) -> dict[str, Any]:
    from agentrl.data import warmup_source
    from agentrl.envs.registry import make_env
    from agentrl.learners.batch import build_batch

    w = cfg.warmup
    env = make_env(cfg.env.name, cfg.env.kwargs)
    tasks = warmup_source(env, cfg.data, w.seed)
    t0 = time.perf_counter()
    losses: list[float] = []
    for step in range(w.steps):
        if w.time_limit_s and time.perf_counter() - t0 > w.time_limit_s:
            break
        demos = demonstration_batch(cfg, env, tokenizer, tasks.next_batch(w.batch_size), str(w.seed + step))
        batch = build_batch(demos, pad_id, cfg.learner.device, images=learner.takes_images)
        stats = learner.sft_step(batch, lr=w.lr)
        losses.append(float(stats.get("loss", stats.get("sft_loss", float("nan")))))
        if w.stop_loss and len(losses) >= STOP_WINDOW and np.mean(losses[-STOP_WINDOW:]) <= w.stop_loss:
            break
    if losses:  # RL starts with fresh moments (see the module docstring)
        learner.reset_optimizer()
    return {
        "warmup_steps": len(losses),
        "warmup_loss_first": losses[0] if losses else float("nan"),
        "warmup_loss_last": float(np.mean(losses[-5:])) if losses else float("nan"),
        "warmup_s": time.perf_counter() - t0,
    }
