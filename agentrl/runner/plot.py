"""`agentrl plot runs/NAME [runs/OTHER ...]`: PNGs of a run's main curves, several runs overlaid.

One PNG per curve of `agentrl.dashboard.curves` (the list the live dashboard draws), each run a colour, each
metric of the curve a line style, a legend when there is more than one line. `NAME=RUN_DIR` puts runs in groups:
the runs of one NAME (the seeds of one setting) share a colour and one legend entry, so a comparison of settings
over several seeds stays readable; `--smooth N` draws the mean of the last N points (noisy per-step rewards). x is the learner step, or the
wall time (`--x wall`). Reads only metrics.jsonl, so it works on a finished run, a running one, or a copy.
matplotlib (a dependency of agentrl) is imported after the arguments are parsed; an install without it gets one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agentrl.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run directories (runs/NAME); NAME=RUN_DIR: runs of one NAME share a colour and a legend entry",
    )
    parser.add_argument(
        "--out",
        default="",
        help="directory for the PNGs (default: RUN_DIR/plots for one run, ./plots for several)",
    )
    parser.add_argument(
        "--x", choices=("step", "wall"), default="step", help="x axis: learner step or wall time"
    )
    parser.add_argument("--all", action="store_true", help="every dashboard curve, not only the main ones")
    parser.add_argument(
        "--smooth",
        type=int,
        default=1,
        metavar="N",
        help="draw the mean of the last N points (default 1: raw)",
    )


def parse_runs(args: list[str]) -> tuple[list[Path], list[str | None]]:
    """RUN_DIR or NAME=RUN_DIR arguments -> (paths, group names; None where none was given). An argument whose
    part before `=` holds a `/` is a path that contains `=`."""
    paths, groups = [], []
    for arg in args:
        name, sep, path = arg.partition("=")
        if sep and name and "/" not in name and path:
            paths.append(Path(path))
            groups.append(name)
        else:
            paths.append(Path(arg))
            groups.append(None)
    return paths, groups


def smoothed(pts: list[tuple[float, float]], n: int) -> list[tuple[float, float]]:
    """Each point's value replaced by the mean of it and the n - 1 before it."""
    if n <= 1:
        return pts
    values = [v for _, v in pts]
    return [
        (x, sum(values[max(0, i - n + 1) : i + 1]) / (i + 1 - max(0, i - n + 1)))
        for i, (x, _) in enumerate(pts)
    ]


def labels(paths: list[Path]) -> list[str]:
    """A legend label per run: its directory name, or its path where two runs share a name."""
    names = [p.name for p in paths]
    return [p.name if names.count(p.name) == 1 else str(p) for p in paths]


def plot_runs(
    paths: list[Path],
    out: Path,
    x: str = "step",
    every: bool = False,
    groups: list[str | None] | None = None,
    smooth: int = 1,
) -> list[Path]:
    """Write the PNGs; returns their paths (a curve no run has data for is skipped). `groups`: a name per run
    (None: the run is its own group, labelled by its directory)."""
    if smooth < 1:
        raise ConfigError(f"agentrl plot: --smooth must be at least 1, got {smooth}")
    from agentrl.dashboard.curves import X_AXES, points, run_curves
    from agentrl.dashboard.runfiles import read_metrics
    from agentrl.runlayout import METRICS_FILE

    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "agentrl plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for path in paths:
        if not (path / METRICS_FILE).is_file():
            raise ConfigError(f"agentrl plot: {path} is not a run directory (no {METRICS_FILE})")
        runs.append(read_metrics(path))
    out.mkdir(parents=True, exist_ok=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = [g or label for g, label in zip(groups or [None] * len(paths), labels(paths), strict=True)]
    colour_of = {name: colours[i % len(colours)] for i, name in enumerate(dict.fromkeys(names))}
    styles = ("-", "--", ":", "-.")
    written = []
    for curve in run_curves([row for rows in runs for row in rows]):
        if not (curve.main or every):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
        n_lines = 0
        legend = set()
        for label, rows in zip(names, runs, strict=True):
            for k, key in enumerate(curve.keys):
                pts = smoothed(points(rows, key, x), smooth)
                if not pts:
                    continue
                name = label if len(curve.keys) == 1 else f"{label} {key}"
                marker = "o" if len(pts) < 30 else None
                ax.plot(*zip(*pts, strict=True), styles[k % len(styles)], color=colour_of[label],
                        label=None if name in legend else name, marker=marker, markersize=3)  # fmt: skip
                legend.add(name)
                n_lines += 1
        if n_lines:
            ax.set_title(curve.title)
            ax.set_xlabel("learner step" if x == "step" else f"wall time (s, {X_AXES[x]})")
            ax.grid(alpha=0.3)
            if len(legend) > 1:
                ax.legend(fontsize=7)
            fig.tight_layout()
            target = out / f"{curve.name}.png"
            fig.savefig(target)
            written.append(target)
        plt.close(fig)
    return written


def main(args: argparse.Namespace) -> int:
    paths, groups = parse_runs(args.runs)
    out = Path(args.out) if args.out else (paths[0] / "plots" if len(paths) == 1 else Path("plots"))
    written = plot_runs(paths, out, args.x, args.all, groups, args.smooth)
    print(f"{len(written)} plots in {out}: {', '.join(p.name for p in written)}")
    return 0
