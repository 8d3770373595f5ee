"""`agentrl plot runs/NAME [runs/OTHER ...]`: PNGs of a run's main curves, several runs overlaid.

One PNG per curve of `agentrl.dashboard.curves` (the list the live dashboard draws), each run a colour, each
metric of the curve a line style, a legend when there is more than one line. x is the learner step, or the
wall time (`--x wall`). Reads only metrics.jsonl, so it works on a finished run, a running one, or a copy.
matplotlib (a dependency of agentrl) is imported after the arguments are parsed; an install without it gets one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agentrl.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (runs/NAME)")
    parser.add_argument(
        "--out",
        default="",
        help="directory for the PNGs (default: RUN_DIR/plots for one run, ./plots for several)",
    )
    parser.add_argument(
        "--x", choices=("step", "wall"), default="step", help="x axis: learner step or wall time"
    )
    parser.add_argument("--all", action="store_true", help="every dashboard curve, not only the main ones")


def labels(paths: list[Path]) -> list[str]:
    """A legend label per run: its directory name, or its path where two runs share a name."""
    names = [p.name for p in paths]
    return [p.name if names.count(p.name) == 1 else str(p) for p in paths]


def plot_runs(paths: list[Path], out: Path, x: str = "step", every: bool = False) -> list[Path]:
    """Write the PNGs; returns their paths (a curve no run has data for is skipped)."""
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
    styles = ("-", "--", ":", "-.")
    written = []
    for curve in run_curves([row for rows in runs for row in rows]):
        if not (curve.main or every):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
        n_lines = 0
        for r, (label, rows) in enumerate(zip(labels(paths), runs, strict=True)):
            for k, key in enumerate(curve.keys):
                pts = points(rows, key, x)
                if not pts:
                    continue
                name = label if len(curve.keys) == 1 else f"{label} {key}"
                marker = "o" if len(pts) < 30 else None
                ax.plot(*zip(*pts, strict=True), styles[k % len(styles)], color=colours[r % len(colours)],
                        label=name, marker=marker, markersize=3)  # fmt: skip
                n_lines += 1
        if n_lines:
            ax.set_title(curve.title)
            ax.set_xlabel("learner step" if x == "step" else f"wall time (s, {X_AXES[x]})")
            ax.grid(alpha=0.3)
            if n_lines > 1:
                ax.legend(fontsize=7)
            fig.tight_layout()
            target = out / f"{curve.name}.png"
            fig.savefig(target)
            written.append(target)
        plt.close(fig)
    return written


def main(args: argparse.Namespace) -> int:
    paths = [Path(p) for p in args.runs]
    out = Path(args.out) if args.out else (paths[0] / "plots" if len(paths) == 1 else Path("plots"))
    written = plot_runs(paths, out, args.x, args.all)
    print(f"{len(written)} plots in {out}: {', '.join(p.name for p in written)}")
    return 0
