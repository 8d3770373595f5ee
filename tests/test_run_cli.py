"""`agentrl run` argument handling: SGLang passthrough flags land in engine.sglang.args (and on the launch line)."""

import argparse

from agentrl.engines.sglang_launcher import sglang_argv
from agentrl.runner import cli as run_cli


def resolve(argv):
    parser = argparse.ArgumentParser()
    run_cli.add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    args.overrides = extra
    return run_cli.resolve(args)


def test_sglang_flags_pass_through():
    cfg = resolve(
        ["examples/gpu_megatron_sglang.toml", "--sglang-mem-fraction-static", "0.55", "--sglang-disable-cuda-graph",
         "--learner.lr", "2e-6"]
    )  # fmt: skip
    assert cfg.engine.sglang.args["mem_fraction_static"] == 0.55
    assert cfg.engine.sglang.args["disable_cuda_graph"] is True
    assert cfg.learner.lr == 2e-6
    argv = sglang_argv("python3", "/m", "127.0.0.1", 30000, cfg.engine.sglang.args)
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.55" and "--disable-cuda-graph" in argv


def test_an_agentrl_error_raised_in_an_actor_is_printed_as_its_one_line(monkeypatch, capsys):
    """Ray re-raises an actor's StorageError as `RayTaskError(StorageError)`, whose str is a traceback."""
    from ray.exceptions import RayTaskError

    from agentrl.cli import main
    from agentrl.errors import StorageError

    cause = StorageError("ledger runs/t/ledger.jsonl: cannot append (No space left on device)")
    wrapped = RayTaskError(
        "QueueActor.commit", "Traceback (most recent call last):\n  ...\nStorageError", cause
    )

    def fails(args):
        raise wrapped.as_instanceof_cause()

    monkeypatch.setattr(run_cli, "main", fails)
    assert main(["run", "examples/quickstart.toml"]) == 2
    assert capsys.readouterr().err == f"agentrl run: error: {cause}\n"
