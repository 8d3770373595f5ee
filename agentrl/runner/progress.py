"""What `agentrl run` prints: one status line per learner step, notes, and the summary block at the end.

The status line (step, policy version, reward, staleness, queue depth, tokens/s, last eval, elapsed time and
the ETA from recent step times, capped by `run.time_limit_s`) fits the terminal's width (80 columns when
there is no terminal): the least important fields (tokens/s, queue, policy version, staleness) are dropped
first, never the trailing ones (eval, elapsed, ETA). In a terminal it is a live line (rich) and notes given
with `keep=True` (the queue's URL, the eval before RL) are printed above it, so they stay on screen; without
one (CI, pipes) every note and status line is a plain `[agentrl] ...` line on stderr.
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
from collections import deque
from typing import Any

PREFIX = "[agentrl] "
BAR_COLUMNS = 10


def duration(seconds: float) -> str:
    """`42s`, `9m05s`, `2h03m`."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def status_line(
    metrics: dict[str, Any],
    total: int,
    width: int,
    eta_s: float | None = None,
    last_eval: float | None = None,
) -> str:
    """The step's fields joined by two spaces, at most `width` characters (see the module docstring)."""
    nan = float("nan")
    fields = [  # (text, drop rank: the highest goes first; 0 is never dropped)
        (f"step {metrics.get('step', 0)}/{total}", 0),
        (f"v{metrics.get('policy_version', 0)}", 4),
        (f"reward {metrics.get('reward_mean', nan):.3f}", 0),
        (f"stale {metrics.get('staleness_mean', 0.0):.2f}/{metrics.get('staleness_max', 0)}", 3),
        (f"queue {metrics.get('queue_depth', 0)}", 5),
        (f"{metrics.get('tokens_per_s', 0.0):.0f} tok/s", 6),
    ]
    if last_eval is not None:
        fields.append((f"eval {last_eval:.3f}", 0))
    fields.append((duration(metrics.get("wall_s", 0.0)), 2))
    if eta_s is not None:
        fields.append((f"ETA {duration(eta_s)}", 0))
    line = "  ".join(text for text, _ in fields)
    for rank in (6, 5, 4, 3, 2):
        if len(line) <= width:
            break
        fields = [f for f in fields if f[1] != rank]
        line = "  ".join(text for text, _ in fields)
    return line[:width]


class Progress:
    def __init__(
        self, total_steps: int, enabled: bool = True, title: str = "agentrl", time_limit_s: float = 0.0
    ):
        self.enabled = enabled
        self.total = total_steps
        self.time_limit_s = time_limit_s
        self.step_times: deque[float] = deque(maxlen=10)
        self.last_eval: float | None = None
        self._bar = None
        self._task = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                BarColumn(bar_width=BAR_COLUMNS),
                TextColumn("{task.fields[line]}"),
                console=Console(stderr=True),
                transient=False,
            )
            self._task = self._bar.add_task(title, total=total_steps, line=f"{title}: starting")
            self._bar.start()

    def note(self, text: str, keep: bool = False) -> None:
        """A message; `keep`: it must stay visible (printed above the live line instead of replacing it)."""
        if not self.enabled:
            return
        if self._bar is None:
            print(f"{PREFIX}{text}", file=sys.stderr, flush=True)
        elif keep:
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            self._bar.update(self._task, line=text[: self._line_width()])

    def eta_s(self, metrics: dict[str, Any]) -> float | None:
        """Seconds left: remaining steps x the mean of the last 10 step times, capped by run.time_limit_s."""
        if not self.step_times:
            return None
        eta = (self.total - metrics.get("step", 0)) * statistics.fmean(self.step_times)
        if self.time_limit_s:
            eta = min(eta, max(0.0, self.time_limit_s - metrics.get("wall_s", 0.0)))
        return eta

    def update(self, metrics: dict[str, Any]) -> None:
        if "step_s" in metrics and math.isfinite(metrics["step_s"]):
            self.step_times.append(float(metrics["step_s"]))
        if "eval_reward_mean" in metrics:
            self.last_eval = float(metrics["eval_reward_mean"])
        if not self.enabled:
            return
        line = status_line(metrics, self.total, self._line_width(), self.eta_s(metrics), self.last_eval)
        if self._bar is not None:
            self._bar.update(self._task, completed=metrics.get("step", 0), line=line)
        else:
            print(f"{PREFIX}{line}", file=sys.stderr, flush=True)

    def _line_width(self) -> int:
        if self._bar is not None:  # the bar and the space rich puts between columns
            return max(20, self._bar.console.width - BAR_COLUMNS - 1)
        return max(20, shutil.get_terminal_size().columns - len(PREFIX))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def format_summary(s: dict[str, Any]) -> str:
    """The block printed when a run ends (and when a finished run is started again): steps, wall time,
    rewards, evals, what to look at when the run did not learn (agentrl.runner.diagnosis), where the files
    are, how to export and how to train further."""
    from agentrl.runner.rundir import shown

    run_dir = shown(s.get("run_dir", "runs/NAME"))
    lines = [
        f"{run_dir}: {s.get('steps', 0)}/{s.get('target_steps', '?')} steps in {duration(s.get('wall_s', 0.0))}"
        f" ({s.get('stopped', 'stopped')})"
    ]
    if "reward_last" in s:
        lines.append(
            f"  reward  last {s['reward_last']:.3f}, best {s['reward_best']:.3f} (step {s['reward_best_step']})"
        )
    if "eval_last" in s:
        first = "before RL" if s["eval_first_step"] == 0 else f"at step {s['eval_first_step']}"
        lines.append(
            f"  eval    {s['eval_first']:.3f} {first} -> {s['eval_last']:.3f} at step {s['eval_last_step']}"
            f" (best {s['eval_best']:.3f}, step {s['eval_best_step']})"
        )
    if s.get("learned") is False:
        lines.append(
            f"  NOT LEARNED: train reward {s['reward_start']:.3f} over the first steps -> "
            f"{s['reward_end']:.3f} over the last; look at:"
        )
        signs = s.get("not_learned") or [
            "the reward itself: no zero-variance groups, entropy collapse, clipping or dropped tokens were "
            "seen (metrics.jsonl: zero_variance_group_frac, train/entropy, train/clip_frac)"
        ]
        lines.extend(f"    - {sign}" for sign in signs)
    checkpoint = s.get("checkpoint", "")
    if checkpoint:
        lines.append(f"  files   metrics.jsonl, events/, checkpoints/{checkpoint.rsplit('/', 1)[-1]}")
        lines.append(f"  export  agentrl export {run_dir} --out {run_dir}/hf")
    if s.get("stopped_by") == "time_limit":
        more = f"--run.time-limit-s {2 * s.get('time_limit_s', 0):g}"
    else:
        done = max(
            int(s.get("target_steps", 0) or 0), int(s.get("steps", 0) or 0)
        )  # resumed with fewer steps
        more = f"--run.steps {2 * (done or 1)}"
    token = "AGENTRL_QUEUE_TOKEN=<the run's queue token> " if s.get("resume_needs_token") else ""
    lines.append(f"  more    {token}agentrl run --resume {run_dir} {more}")
    return "\n".join(lines)
