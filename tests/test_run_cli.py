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
