"""The progress display: one live line (rich) with step, policy version, reward, queue depth and staleness.

Without a terminal (CI, pipes) it prints one plain line per step instead, so logs stay readable.
"""

from __future__ import annotations

import sys
from typing import Any


def _fmt(metrics: dict[str, Any]) -> str:
    parts = [
        f"step {metrics.get('step', 0)}",
        f"v{metrics.get('policy_version', 0)}",
        f"reward {metrics.get('reward_mean', float('nan')):.3f}",
        f"queue {metrics.get('queue_depth', 0)}",
        f"stale {metrics.get('staleness_mean', 0.0):.2f}/{metrics.get('staleness_max', 0)}",
        f"{metrics.get('tokens_per_s', 0.0):.0f} tok/s",
        f"{metrics.get('wall_s', 0.0):.0f}s",
    ]
    if "eval_reward_mean" in metrics:
        parts.append(f"eval {metrics['eval_reward_mean']:.3f}")
    return " | ".join(parts)


class Progress:
    def __init__(self, total_steps: int, enabled: bool = True, title: str = "agentrl"):
        self.enabled = enabled
        self.total = total_steps
        self._bar = None
        self._task = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn(f"[bold]{title}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[line]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._task = self._bar.add_task(title, total=total_steps, line="starting")
            self._bar.start()

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, line=text)
        else:
            print(f"[agentrl] {text}", file=sys.stderr, flush=True)

    def update(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = _fmt(metrics)
        if self._bar is not None:
            self._bar.update(self._task, completed=metrics.get("step", 0), line=line)
        else:
            print(f"[agentrl] {line}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
