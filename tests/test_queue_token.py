"""Where the queue's token comes from (flag, $AGENTRL_QUEUE_TOKEN, queue.token_file), and a run whose queue is
off loopback refused before anything starts when none is given: `agentrl run --resume` of such a run works as
its closing line prints it."""

from pathlib import Path

from agentrl.cli import main
from agentrl.config import load_config
from agentrl.config.text import dump_toml
from agentrl.runner.rundir import redact


def _saved_run(tmp_path: Path, *flags: str) -> Path:
    """A run directory as `agentrl run` leaves it: config.toml without the token."""
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    cfg = load_config(["examples/quickstart.toml"], ["--queue.host", "0.0.0.0", *flags])
    (run / "config.toml").write_text(dump_toml(redact(cfg)))
    return run


def _files(path: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_resume_off_loopback_without_a_token_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("AGENTRL_QUEUE_TOKEN", raising=False)
    run = _saved_run(tmp_path, "--queue.token", "s3cret")
    assert "s3cret" not in (run / "config.toml").read_text()
    before = _files(run)
    assert main(["run", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert (
        "non-loopback address '0.0.0.0' (queue.host)" in err
        and "$AGENTRL_QUEUE_TOKEN" in err
        and "--queue.token-file" in err
    )
    assert _files(run) == before  # nothing written, nothing removed


def test_the_token_comes_back_from_the_environment_or_the_token_file(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("AGENTRL_QUEUE_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    run = _saved_run(tmp_path, "--queue.token-file", str(token_file))
    assert main(["run", "--resume", str(run), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        f'token_file = "{token_file}"' in out and "from-file" not in out
    )  # the path is kept, never the token
    monkeypatch.setenv("AGENTRL_QUEUE_TOKEN", "from-env")
    run2 = _saved_run(tmp_path / "b")
    assert main(["run", "--resume", str(run2), "--dry-run"]) == 0


def test_a_token_file_that_gives_no_token_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("AGENTRL_QUEUE_TOKEN", raising=False)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, why in ((empty, "first line is empty"), (tmp_path / "missing", "cannot read it")):
        assert main(["run", "examples/quickstart.toml", "--queue.token-file", str(path), "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert f"queue.token_file = '{path}'" in err and why in err
