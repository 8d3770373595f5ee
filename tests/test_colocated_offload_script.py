"""bench/gpu/colocated_offload.py's own logic on a CPU (`--engine embedded --device cpu --arch tiny`), everything
but the SGLang server: flags, the torch learner with and without LoRA, the hand-off, what a publish sends (the
adapter alone vs every weight), the served-policy check and the JSON summary. The GPU cases are
bench/gpu/colocated_offload.sh."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--arch", "tiny", "--engine", "embedded", "--device", "cpu", "--steps", "2", "--prompts", "2",
         "--samples", "2", "--prompt-len", "8", "--new-tokens", "4"]  # fmt: skip

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "colocated_offload", ROOT / "bench/gpu/colocated_offload.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(script, tmp_path_factory):
    """(LoRA with the hand-off, full weights without it), sharing one tiny model."""
    work, out = tmp_path_factory.mktemp("work"), tmp_path_factory.mktemp("out")
    common = [*SMOKE, "--workdir", str(work), "--out", str(out)]
    lora = script.main([*common, "--lora", "--offload"])
    full = script.main([*common, "--no-offload"])
    lines = [json.loads(line) for line in (out / "colocated_offload.jsonl").read_text().splitlines()]
    return lora, full, lines, work


def test_lora_case_trains_publishes_the_adapter_and_checks_what_was_served(runs):
    lora, _, lines, work = runs
    assert lora["ok"] and not lora["oom"] and lora["lora_rank"] == 16 and lora["offload"]
    assert lora["base_dtype"] == "float32"  # the torch learner keeps the frozen base in fp32 (documented)
    # the publish is the adapter's safetensors (fp32: 4 bytes a trainable parameter, + a small header)
    assert lora["publish_mb"] == pytest.approx(lora["trainable_params_m"] * 4, rel=0.05)
    # the engine served base + adapter: its log-probs are the learner's, far from the base's
    assert lora["adapter_served"] and lora["served_vs_learner"] < 1e-4 < lora["served_vs_base"]
    assert lora["logprob_mismatch_max"] < 1e-4
    steps = lines[0]["steps"]
    assert [s["step"] for s in steps] == [0, 1] and all("handoff/publish_s" in s for s in steps)
    assert lora["step_s_median"] == steps[1]["step_s"]  # step 0 (one-time costs) is left out
    kept = sorted(p.name for p in (work / "adapters_tiny_True").iterdir())
    assert kept == ["v1", "v2"]  # versions 0, 1, 2 published; the last two kept


def test_full_weight_case_publishes_every_weight(runs):
    lora, full, lines, _ = runs
    assert full["ok"] and full["lora_rank"] == 0 and not full["offload"]
    assert "served_vs_base" not in full and "handoff/publish_s" not in lines[1]["steps"][0]
    assert full["publish_mb"] == pytest.approx(full["trainable_params_m"] * 4, rel=0.05)  # fp32, every weight
    assert lora["publish_mb"] < full["publish_mb"] / 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cpu"], "--device cpu needs --engine embedded"),
        (
            ["--engine", "embedded", "--device", "cpu", "--lora", "--lora-rank", "0"],
            "--lora-rank must be >= 1",
        ),
        (["--engine", "embedded", "--device", "cpu", "--new-tokens", "0"], "--new-tokens must be >= 1"),
    ],
)
def test_bad_flags_are_refused_by_name(script, capsys, argv, message):
    with pytest.raises(SystemExit):
        script.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_time_limit_cuts_steps_but_keeps_the_summary(script, tmp_path):
    result = script.main([*SMOKE, "--steps", "50", "--time-limit-s", "1e-3", "--workdir", str(tmp_path),
                          "--out", str(tmp_path)])  # fmt: skip
    assert result["ok"] and result["steps_cut_at"] == 1 and "step_s_median" in result


def test_expandable_segments_uses_the_colocated_hosts_allocator_call(script, monkeypatch, tmp_path):
    """--expandable-segments sets the allocator through agentrl.actors.colocated.allocator_settings (one copy of
    the torch-version fallback), only on CUDA; the run itself is stubbed out (no GPU here)."""
    from agentrl.actors import colocated

    assert script.allocator_settings is colocated.allocator_settings
    calls = []
    monkeypatch.setattr(script, "allocator_settings", calls.append)

    async def run(args):
        return {"ok": True}

    monkeypatch.setattr(script, "run", run)
    script.main(["--engine", "embedded", "--device", "cpu", "--expandable-segments", "--out", str(tmp_path)])
    assert calls == []
    script.main(["--engine", "embedded", "--device", "cuda", "--expandable-segments", "--out", str(tmp_path)])
    assert calls == ["expandable_segments:True"]
