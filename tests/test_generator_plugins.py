"""The top-level generators/ directory: plugins found by file name with the task type they declare (real files
in a tmp dir, and the shipped ones), run by `agentrl generate` against a real `agentrl serve-queue` on
loopback; and `pip install .` installs no top-level `generators` package."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.cli import main as cli
from agentrl.config.text import tomllib
from agentrl.errors import ConfigError
from agentrl.generator_plugins import GeneratorContext, discover, load_main, search_dirs, shipped_dir

ROOT = Path(__file__).resolve().parents[1]

FILES = {
    "counter.py": '"""Counts to three.\n\nMore words."""\nTASK = "calculator"\n\ndef main(ctx):\n    return len(ctx.argv)\n',
    "poller.py": 'TASK: str = "guess_number"\n\nasync def main(ctx):\n    return 7\n',
    "no_task.py": "def main(ctx):\n    pass\n",
    "no_main.py": 'TASK = "calculator"\n',
    "computed.py": 'NAME = "x"\nTASK = NAME\n\ndef main(ctx):\n    pass\n',
    "broken.py": "def main(ctx)\n",
    "_helpers.py": 'TASK = "calculator"\n\ndef main(ctx):\n    pass\n',
    "notes.txt": "not python",
}


def write(d: Path, files: dict[str, str]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_discovery_reads_each_files_task_and_main_without_running_it(tmp_path):
    (tmp_path / "ran").unlink(missing_ok=True)
    files = {
        **FILES,
        "loud.py": f'open({str(tmp_path / "ran")!r}, "w")\nTASK = "x"\n\ndef main(ctx):\n    pass\n',
    }
    found = discover([write(tmp_path / "gens", files)])
    assert sorted(found) == ["broken", "computed", "counter", "loud", "no_main", "no_task", "poller"]
    assert not (tmp_path / "ran").exists()  # a listing imports nothing
    counter, poller = found["counter"], found["poller"]
    assert (counter.task, counter.description, counter.error) == ("calculator", "Counts to three.", "")
    assert (poller.task, poller.error) == ("guess_number", "")
    assert found["no_task"].error == 'declares no TASK = "<task type>"'
    assert found["no_main"].error == "has no main(ctx) function"
    assert found["computed"].error == "TASK must be a non-empty string literal"
    assert found["broken"].error.startswith("cannot be read")
    assert load_main(counter)(GeneratorContext(argv=["a", "b"])) == 2
    with pytest.raises(ConfigError, match=r"generator 'no_main' \(.*no_main.py\) has no main\(ctx\)"):
        load_main(found["no_main"])


def test_the_first_directory_holding_a_name_wins(tmp_path, monkeypatch):
    first = write(tmp_path / "first", {"counter.py": 'TASK = "first"\n\ndef main(ctx):\n    pass\n'})
    later = write(tmp_path / "later", FILES)
    monkeypatch.setenv("AGENTRL_GENERATORS", str(later))
    monkeypatch.chdir(tmp_path)
    dirs = search_dirs([str(first)])
    assert dirs[:2] == [first, later] and dirs[-1] == shipped_dir()
    found = discover(dirs)
    assert found["counter"].task == "first" and found["poller"].path.parent == later
    assert {"queue_demo", "external_http_agent"} <= set(found)  # the shipped ones come last


def test_the_shipped_generators_are_valid_plugins():
    found = discover([shipped_dir()])
    assert {p.path.name for p in found.values()} == {p.name for p in (ROOT / "generators").glob("*.py")}
    assert {n: p.error for n, p in found.items() if p.error} == {}
    assert found["queue_demo"].task == "external_demo" and found["external_http_agent"].task == "*"


def test_agentrl_generate_lists_runs_and_refuses_by_name(tmp_path, capsys):
    gens = write(tmp_path / "gens", FILES)
    assert cli(["generate", "--list", "--dir", str(gens)]) == 0
    listed = capsys.readouterr().out
    assert re.search(r"^counter +\[task calculator\] Counts to three\.$", listed, re.M), listed
    assert re.search(r"^no_task +ERROR declares no TASK", listed, re.M), listed
    assert cli(["generate", "counter", "--dir", str(gens), "--", "x", "y", "z"]) == 3
    assert cli(["generate", "poller", "--dir", str(gens)]) == 7  # an async main runs to its end
    assert cli(["generate", "missing", "--dir", str(gens)]) == 2
    assert cli(["generate", "no_main", "--dir", str(gens)]) == 2
    err = capsys.readouterr().err
    assert "no generator named 'missing'; found: broken, computed, counter" in err
    assert "generator 'no_main'" in err and "has no main(ctx) function" in err
    assert cli(["generate", "counter", "--dir", str(gens), "--token-file", str(tmp_path / "none")]) == 2
    assert "--token-file" in capsys.readouterr().err


def test_a_shipped_generator_submits_to_a_real_serve_queue_on_loopback(tmp_path, tiny, monkeypatch, capsys):
    token = tmp_path / "token"
    token.write_text("s3cret-token-value\n")
    env = {**os.environ, "AGENTRL_QUEUE_TOKEN": "s3cret-token-value", "PYTHONPATH": str(ROOT)}
    serve = [sys.executable, "-m", "agentrl.cli", "serve-queue", "--port", "0", "--run-dir", str(tmp_path / "q"),
             "--model", str(tiny)]  # fmt: skip
    proc = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = next(
            (m.group(1) for line in proc.stdout if (m := re.search(r"listening on (http://\S+)", line))), ""
        )
        assert url, "serve-queue did not print its URL"
        monkeypatch.delenv("AGENTRL_QUEUE_TOKEN", raising=False)  # the token comes from the file
        monkeypatch.chdir(tmp_path)  # no ./generators: the shipped one is found
        argv = ["generate", "queue_demo", "--queue", url, "--token-file", str(token), "--", "--groups", "2",
                "--group-size", "3"]  # fmt: skip
        assert cli(argv) == 0
        out = capsys.readouterr().out
        accepted = re.findall(r"^(token|chat) form: +\{'accepted': (\d+)", out, re.M)
        assert accepted == [("token", "3"), ("token", "3"), ("chat", "1")], out
        assert re.search(r"^queue depth 7, ", out, re.M), out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)


def test_pip_install_installs_no_top_level_generators_package():
    """The package list setuptools builds the wheel from (pyproject's find config) holds agentrl's packages only."""
    from setuptools import find_namespace_packages, find_packages

    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py-modules" not in setuptools_cfg and "packages" in setuptools_cfg
    find = setuptools_cfg["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    packages = finder(where=str(ROOT), include=find.get("include", ["*"]), exclude=find.get("exclude", []))
    assert "agentrl" in packages and "agentrl.proxy" in packages
    assert all(p == "agentrl" or p.startswith("agentrl.") for p in packages), packages
    assert (ROOT / "generators").is_dir() and not any(p.split(".")[0] == "generators" for p in packages)
