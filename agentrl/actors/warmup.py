"""Supervised warm-up (`[warmup]`): a few SFT steps on the env's demonstrations before RL.

Demonstrations are tokenized exactly as a multi-turn rollout of the same conversation would be
(agentrl.chat.demonstration_images; pictures stored once and placed, as a rollout records them): loss on assistant
tokens and their end-of-turn, none on env/tool tokens. It runs `warmup.steps` steps, or fewer, so that where it
ends is a state of the model, not a step count (the same step count leaves different states on machines whose
vector width changes the floating-point order): `warmup.stop_eval` ends it once the run's greedy eval reaches a
reward (the trainer publishes the weights and evaluates them every `warmup.eval_every` steps: the task success RL
starts from), `warmup.stop_loss` once the SFT loss is low enough (a cruder state: the same loss was measured to
leave greedy evals from 0.26 to 0.93 on different vector widths). Tasks come from `warmup.seed`
(agentrl.data.warmup_source): env tasks from a seed range apart from training and evaluation, or, with
`data.path`, the dataset's rows in a `warmup.seed` order. Afterwards (at its end: `Warmup.end`) the optimizer's
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


class Warmup:
    """The warm-up of one run, run in chunks (`advance`): the trainer evaluates the weights between chunks when
    `warmup.stop_eval` is set, and ends the warm-up (`end`) once the eval reaches it. Holds the task iterator,
    the losses and the clock, so a chunk goes on where the one before stopped."""

    def __init__(self, cfg: Config, learner: Any, tokenizer: Any, pad_id: int):
        from agentrl.data import warmup_source
        from agentrl.envs.registry import make_env

        self.cfg, self.learner, self.tokenizer, self.pad_id = cfg, learner, tokenizer, pad_id
        self.env = make_env(cfg.env.name, cfg.env.kwargs)
        self.tasks = warmup_source(self.env, cfg.data, cfg.warmup.seed)
        self.t0 = time.perf_counter()
        self.losses: list[float] = []
        self.ended = False

    def _out_of_steps(self) -> bool:
        """Whether `warmup.steps`, `warmup.time_limit_s` or `warmup.stop_loss` says the warm-up is over."""
        w, losses = self.cfg.warmup, self.losses
        if len(losses) >= w.steps or (w.time_limit_s and time.perf_counter() - self.t0 > w.time_limit_s):
            return True
        return bool(
            w.stop_loss and len(losses) >= STOP_WINDOW and np.mean(losses[-STOP_WINDOW:]) <= w.stop_loss
        )

    def advance(self, steps: int = 0) -> dict[str, Any]:
        """Up to `steps` more SFT steps (0: until the warm-up is over); ends the warm-up when it is over."""
        from agentrl.learners.batch import build_batch

        w = self.cfg.warmup
        target = len(self.losses) + steps if steps else w.steps
        while not self.ended and len(self.losses) < target and not self._out_of_steps():
            step = len(self.losses)
            tasks = self.tasks.next_batch(w.batch_size)
            demos = demonstration_batch(self.cfg, self.env, self.tokenizer, tasks, str(w.seed + step))
            batch = build_batch(demos, self.pad_id, self.cfg.learner.device, images=self.learner.takes_images)
            stats = self.learner.sft_step(batch, lr=w.lr)
            self.losses.append(float(stats.get("loss", stats.get("sft_loss", float("nan")))))
        if not self.ended and self._out_of_steps():
            return self.end()
        return self.stats()

    def end(self) -> dict[str, Any]:
        """End the warm-up here: RL starts with fresh moments (see the module docstring)."""
        if not self.ended and self.losses:
            self.learner.reset_optimizer()
        self.ended = True
        return self.stats()

    def stats(self) -> dict[str, Any]:
        losses = self.losses
        return {
            "warmup_steps": len(losses),
            "warmup_loss_first": losses[0] if losses else float("nan"),
            "warmup_loss_last": float(np.mean(losses[-STOP_WINDOW:])) if losses else float("nan"),
            "warmup_s": time.perf_counter() - self.t0,
            "warmup_ended": self.ended,
        }


def run_warmup(cfg: Config, learner: Any, tokenizer: Any, pad_id: int) -> dict[str, Any]:
    """The whole warm-up in one call (no evals between chunks)."""
    return Warmup(cfg, learner, tokenizer, pad_id).advance()
