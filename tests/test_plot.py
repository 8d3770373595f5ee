"""`agentrl plot`: PNGs of a real short run's curves, two runs overlaid, wall-time axis, bad input named."""

from __future__ import annotations

import shutil

import pytest

from agentrl.cli import main
from agentrl.dashboard.curves import CURVES
from tests.dashboard_support import short_run

pytestmark = pytest.mark.slow  # one short real `agentrl run` per session (tests/dashboard_support.py)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return short_run(tmp_path_factory)


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
