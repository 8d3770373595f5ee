"""Queue metrics: counters, a staleness histogram and wait-time summaries, as a dict and as Prometheus text.

Invariants: counters only grow; gauges (depth, bytes, ...) are read from the queue when rendered, never cached.
Nothing here awaits or locks: every update happens on the event loop thread.
"""

from __future__ import annotations

from typing import Any

COUNTERS = (
    "accepted",
    "duplicates",
    "rejected_invalid",
    "rejected_full",
    "dropped_stale",
    "dropped_straggler",
    "dropped_late",
    "kept_stale",
    "released_partial",
    "sampled",
    "committed",
    "storage_errors",
)


class WaitStats:
    """Count, sum and max of waits in seconds."""

    __slots__ = ("count", "max_s", "sum_s")

    def __init__(self) -> None:
        self.count = 0
        self.sum_s = 0.0
        self.max_s = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum_s += seconds
        self.max_s = max(self.max_s, seconds)

    def as_dict(self) -> dict[str, float]:
        mean = self.sum_s / self.count if self.count else 0.0
        return {"count": self.count, "sum_s": self.sum_s, "mean_s": mean, "max_s": self.max_s}


class QueueMetrics:
    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.staleness: dict[int, int] = {}  # staleness at sample time -> trajectories
        self.sample_wait = WaitStats()
        self.reserve_wait = WaitStats()

    def inc(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def observe_staleness(self, staleness: int, n: int = 1) -> None:
        self.staleness[staleness] = self.staleness.get(staleness, 0) + n

    def as_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "sample_wait": self.sample_wait.as_dict(),
            "reserve_wait": self.reserve_wait.as_dict(),
        }


def prometheus_text(status: dict[str, Any], prefix: str = "agentrl_queue") -> str:
    """Render `ReplayQueue.status()` in the Prometheus text exposition format (version 0.0.4)."""
    lines: list[str] = []

    def metric(name: str, kind: str, value: float, labels: str = "") -> None:
        full = f"{prefix}_{name}"
        if not any(line.startswith(f"# TYPE {full} ") for line in lines[-4:]):
            lines.append(f"# TYPE {full} {kind}")
        lines.append(f"{full}{labels} {float(value):g}")

    for key in ("depth", "ready", "pending_groups", "in_sample", "bytes", "in_flight", "policy_version"):
        metric(key, "gauge", status[key])
    metric("draining", "gauge", 1.0 if status["draining"] else 0.0)
    for key, value in status["counts"].items():
        metric(f"{key}_total", "counter", value)
    cumulative, total = 0, 0
    full = f"{prefix}_staleness"
    lines.append(f"# TYPE {full} histogram")
    for bucket, count in status["staleness"].items():
        cumulative += count
        total += int(bucket) * count
        lines.append(f'{full}_bucket{{le="{bucket}"}} {cumulative}')
    lines.append(f'{full}_bucket{{le="+Inf"}} {cumulative}')
    lines.append(f"{full}_sum {total}")
    lines.append(f"{full}_count {cumulative}")
    for wait in ("sample_wait", "reserve_wait"):
        stats = status[wait]
        lines.append(f"# TYPE {prefix}_{wait}_seconds summary")
        lines.append(f"{prefix}_{wait}_seconds_sum {stats['sum_s']:g}")
        lines.append(f"{prefix}_{wait}_seconds_count {stats['count']}")
    return "\n".join(lines) + "\n"
