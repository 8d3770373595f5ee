"""`agentrl plot`: PNGs of a real short run's curves, two runs overlaid, wall-time axis, bad input named."""

from __future__ import annotations

import shutil

import pytest

from agentrl.cli import main
from agentrl.dashboard.curves import CURVES
from tests.dashboard_support import short_run

pytestmark = pytest.mark.slow  # one short real `agentrl run` per session (tests/dashboard_support.py)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, run_model):
    return short_run(tmp_path_factory, run_model)


def _image(path):
    import matplotlib.pyplot as plt

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    pixels = plt.imread(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    return pixels


def test_plot_writes_the_main_curves_of_two_runs(run_dir, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(run_dir / "metrics.jsonl", other / "metrics.jsonl")
    out = tmp_path / "plots"
    assert main(["plot", str(run_dir), str(other), "--out", str(out)]) == 0
    written = sorted(p.name for p in out.glob("*.png"))
    assert written == sorted(f"{c.name}.png" for c in CURVES if c.main)
    for png in out.glob("*.png"):
        _image(png)
    assert "9 plots in" in capsys.readouterr().out


def test_plot_wall_time_and_every_curve_default_out(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "*.lock"))
    assert main(["plot", str(copy), "--x", "wall", "--all"]) == 0
    names = {p.stem for p in (copy / "plots").glob("*.png")}
    assert {"reward", "queue", "publish", "restarts"} <= names
    _image(copy / "plots" / "reward.png")


def test_plot_names_a_directory_that_holds_no_run(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "metrics.jsonl" in err


def test_plot_groups_seeds_of_one_setting_and_smooths(run_dir, tmp_path, capsys):
    """NAME=RUN_DIR: the runs of one NAME share one colour and one legend entry; --smooth 0 is refused by name."""
    import matplotlib.pyplot as plt

    from agentrl.runner import plot

    seeds = []
    for i in range(3):
        seeds.append(tmp_path / f"seed{i}")
        seeds[-1].mkdir()
        shutil.copy(run_dir / "metrics.jsonl", seeds[-1] / "metrics.jsonl")
    paths, groups = plot.parse_runs([f"cpu={seeds[0]}", f"cpu={seeds[1]}", f"gpu={seeds[2]}", str(run_dir)])
    assert paths == [*seeds, run_dir] and groups == ["cpu", "cpu", "gpu", None]
    assert plot.smoothed([(0, 1.0), (1, 3.0), (2, 5.0)], 2) == [(0, 1.0), (1, 2.0), (2, 4.0)]

    drawn = []
    real_savefig = plt.Figure.savefig

    def keep_legend(fig, target, *args, **kwargs):
        legend = fig.axes[0].get_legend()
        drawn.append([t.get_text() for t in legend.get_texts()] if legend else [])
        return real_savefig(fig, target, *args, **kwargs)

    plt.Figure.savefig = keep_legend
    try:
        out = tmp_path / "plots"
        argv = [
            "plot",
            f"cpu={seeds[0]}",
            f"cpu={seeds[1]}",
            f"gpu={seeds[2]}",
            "--smooth",
            "3",
            "--out",
            str(out),
        ]
        assert main(argv) == 0
    finally:
        plt.Figure.savefig = real_savefig
    entropy = [texts for texts in drawn if texts and all(" " not in t for t in texts)]
    assert ["cpu", "gpu"] in entropy  # a one-metric curve: one entry per group, not per run
    assert main(["plot", str(run_dir), "--smooth", "0", "--out", str(out)]) == 2
    assert "--smooth" in capsys.readouterr().err
