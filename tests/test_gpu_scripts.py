"""The GPU reproductions, checked on any machine: every bench/gpu script parses, its shared helper refuses bad
input by name, every GPU row of docs/benchmarks.md names the bench/gpu script that reproduces it, every script the
docs name exists, and the engine comparison reports its first (cold) run apart from the later ones."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_SCRIPTS = sorted((ROOT / "bench/gpu").glob("*.sh"))
GPU_WORDS = re.compile(r"GPU|H100|H200|SGLang|NCCL|Megatron|FSDP")


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_install_helper_names_what_it_refuses(tmp_path):
    cmd = 'source bench/gpu/common.sh; gpu_install sglang-typo; echo "rc=$?"'
    proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True)  # fmt: skip
    assert "rc=2" in proc.stdout and "sglang-typo" in proc.stderr, proc.stdout + proc.stderr


def test_old_gpu_tools_are_gone():
    assert not (ROOT / "tools/gpu").exists()


def _summary_rows() -> list[list[str]]:
    text = (ROOT / "docs/benchmarks.md").read_text()
    rows = [
        line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "---" not in line
    ]
    return [cells for cells in rows[1:] if len(cells) == 5]


def test_every_gpu_row_names_its_bench_gpu_script():
    rows = [cells for cells in _summary_rows() if GPU_WORDS.search(cells[0] + cells[2])]
    assert len(rows) >= 10
    missing = [cells[0].strip() for cells in rows if "bench/gpu/" not in cells[1]]
    assert not missing, f"GPU rows without a bench/gpu command: {missing}"


def test_every_named_script_exists():
    docs = [
        ROOT / "docs/benchmarks.md",
        *sorted((ROOT / "docs/benchmarks").glob("*.md")),
        ROOT / "bench/gpu/README.md",
    ]
    named = {m for doc in docs for m in re.findall(r"bench/gpu/[\w.]+\.(?:sh|py)", doc.read_text())}
    assert named, "no bench/gpu script named in the docs"
    assert not [n for n in named if not (ROOT / n).exists()]


def test_engine_comparison_reports_cold_and_later_runs_apart(tmp_path):
    sys.path.insert(0, str(ROOT / "bench/gpu"))
    from engine_vs_sglang import main

    out = tmp_path / "r.json"
    result = main(["--device", "cpu", "--arch", "tiny", "--n", "4", "--prompt-len", "4", "8", "--output-len", "4", "8",
                   "--variants", "eager", "--runs", "3", "--no-sglang", "--out", str(out)])  # fmt: skip
    runs = result["embedded_eager"]
    assert runs["cold"]["tokens"] > 0 and len(runs["later"]) == 2
    later = [r["tok_s"] for r in runs["later"]]
    assert min(later) <= runs["later_tok_s_median"] <= max(later)
    assert out.exists()
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--variants", "no_such_variant", "--no-sglang"])


def _metrics(run: Path, step_s: list[float], start_s: float) -> None:
    run.mkdir(parents=True)
    wall, lines = start_s, [json.dumps({"step": 0, "phase": "warmup", "warmup_steps": 3})]
    for i, dt in enumerate(step_s, 1):
        wall += dt
        lines.append(json.dumps({"step": i, "step_s": dt, "wall_s": wall, "n_trajectories": 64, "publish_s": 0.01 * i,
                                 "staleness_mean": 0.5, "train/logprob_mismatch": 0.002}))  # fmt: skip
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_run_summary_spreads_and_async_sync_ratio(tmp_path):
    """Loop time excludes start-up; the ratio covers only the steps both runs made (the same samples)."""
    _metrics(tmp_path / "a", [5.0] + [1.0] * 9, start_s=100.0)
    _metrics(tmp_path / "s", [2.0] * 8, start_s=30.0)  # stopped at step 8
    out = tmp_path / "sum.json"
    proc = subprocess.run([sys.executable, "bench/gpu/run_summary.py", str(tmp_path / "a"), str(tmp_path / "s"),
                           "--compare", "--out", str(out)], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    a = result["runs"][0]
    assert a["steps"] == 10 and a["trajectories"] == 640 and a["loop_s"] == 14.0
    assert a["step_s"]["median"] == 1.0 and a["step_s"]["max"] == 5.0 and a["step_s"]["p90"] == 1.0
    assert a["publish_s"]["min"] == 0.01 and a["publish_s"]["p10"] == 0.02 and a["publish_s"]["max"] == 0.1
    pair = result["compare"][0]
    assert pair["steps"] == 8 and pair["same_samples"] and pair["trajectories"] == 512
    assert pair["async_loop_s"] == 12.0 and pair["sync_loop_s"] == 16.0 and pair["ratio"] == round(16 / 12, 3)
    assert pair["ratio_from_step2"] == 2.0  # 14 s of sync steps 2-8 over 7 s of async ones
    odd = subprocess.run([sys.executable, "bench/gpu/run_summary.py", str(tmp_path / "a"), "--compare"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert odd.returncode == 2 and "pairs" in odd.stderr


def test_run_summary_repeats_per_mode(tmp_path):
    """Two runs per mode: loop times over the steps every run made (the shortest stopped at 6), per mode median
    and spread, and the ratio of the medians with its extremes."""
    for name, times in (("a1", [1.0] * 8), ("s1", [2.0] * 8), ("a2", [3.0] * 6), ("s2", [4.0] * 7)):
        _metrics(tmp_path / name, times, start_s=10.0)
    dirs = [str(tmp_path / n) for n in ("a1", "s1", "a2", "s2")]
    proc = subprocess.run([sys.executable, "bench/gpu/run_summary.py", *dirs, "--compare"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)["repeats"]
    assert rep["steps"] == 6 and rep["runs_per_mode"] == {"async": 2, "sync": 2}
    assert (
        rep["async_loop_s"]["median"] == 12.0 and rep["sync_loop_s"]["median"] == 18.0
    )  # (6+18)/2, (12+24)/2
    assert rep["ratio"] == {"median": 1.5, "min": round(12 / 18, 3), "max": 4.0}
    assert rep["ratio_from_step2"]["median"] == 1.5 and rep["sync_step_s"]["median"] == 3.0


def test_run_summary_loop_time_of_a_resumed_run(tmp_path):
    """A run continued with --resume (its time limit stopped it at step 4; step 4 redone after the restart): the
    loop time is the steps' own times, the restart's 150 s of start-up and the first attempt at step 4 left out."""
    run = tmp_path / "r"
    _metrics(run, [1.0] * 4, start_s=60.0)
    rows = [json.dumps({"step": k, "step_s": 2.0, "wall_s": 64.0 + 150.0 + 2.0 * (k - 3), "n_trajectories": 64})
            for k in (4, 5, 6)]  # fmt: skip
    with (run / "metrics.jsonl").open("a") as f:
        f.write("\n".join(rows) + "\n")
    out = tmp_path / "sum.json"
    proc = subprocess.run([sys.executable, "bench/gpu/run_summary.py", str(run), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (r,) = json.loads(out.read_text())
    assert r["steps"] == 6 and r["loop_s"] == 3.0 + 3 * 2.0 and r["trajectories"] == 6 * 64


def test_moe_r3_config_takes_the_scripts_flags(tmp_path):
    """`moe_checks.sh r3`'s run, as the script starts it (common.sh's flag sets, routing replay on and off),
    passes `agentrl run --dry-run`: every key exists, the reward module resolves from the config's directory,
    and SGLang's placement settings reach engine.sglang.args."""
    for replay in ("rollout", "off"):
        cmd = ('source bench/gpu/common.sh; python3 -m agentrl.cli run bench/gpu/moe_r3.toml --dry-run '
               f'--model.path {tmp_path}/m --run.steps 50 "${{MEGATRON_GPU[@]}}" "${{SGLANG_GPU[@]}}" '
               f'--learner.routing-replay {replay}')  # fmt: skip
        env = {
            "OUT": str(tmp_path),
            "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
        }
        proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        text = proc.stdout
        assert f'routing_replay = "{replay}"' in text and "expert_parallel = 2" in text, text
        assert "base_gpu_id = 1" in text and 'kind = "sglang"' in text and "learner ranks = 2" in text


def test_moe_r3_summary_medians_and_rows(tmp_path):
    """bench/gpu/moe_r3.py: the rewards, per run one JSON line of medians over steps and a markdown row (n/a
    for metrics a run did not report: no router agreement without replay), per setting the median over its
    runs, and the pair compared at matched steps."""
    sys.path.insert(0, str(ROOT / "bench/gpu"))
    from moe_r3 import counting_score, digit_share

    assert digit_share("a1b2", {}) == 0.5 and digit_share("", {}) == 0.0
    # "1234": all digits, 3 of 3 pairs count up; "19a0": 3 digits of 4, no pair counts up; "90": 9 wraps to 0
    assert counting_score("1234", {}) == 1.0 and counting_score("19a0", {}) == 0.5 * 0.75 + 0.5 * (0 / 3)
    assert counting_score("90", {}) == 1.0 and counting_score("", {}) == 0.0
    for name, replay, agreement in (("on", "rollout", [0.9, 0.95, 0.93]), ("off", "off", None)):
        run = tmp_path / name
        run.mkdir()
        (run / "config.toml").write_text(
            f'[learner]\nrouting_replay = "{replay}"\nexpert_parallel = 2\n[model]\npath = "{tmp_path}/m"\n'
        )
        rows = []
        for i in range(3):
            row = {
                "step": i + 1,
                "step_s": 1.0 + i + (0.5 if agreement else 0.0),
                "publish_s": 0.1 * (i + 1),
                "train/logprob_mismatch": 0.01 if agreement else 0.03,
                "reward_mean": 0.2 + 0.1 * i,
            }
            if agreement:
                row.update(
                    {"train/router_agreement": agreement[i], "train/logprob_mismatch_no_replay": 0.025}
                )
            rows.append(json.dumps(row))
        (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    proc = subprocess.run([sys.executable, "bench/gpu/moe_r3.py", "summary", str(tmp_path / "on"), str(tmp_path / "off"),
                           "--out", str(tmp_path / "s.json")], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    on, off = json.loads(lines[0]), json.loads(lines[1])
    assert on["steps"] == 3 and on["step_s"]["median"] == 2.5 and on["publish_s"]["median"] == 0.2
    assert on["router_agreement"]["median"] == 0.93 and on["logprob_mismatch_no_replay"]["median"] == 0.025
    assert on["step1"]["router_agreement"] == 0.9 and on["reward_mean"]["median"] == 0.3
    assert off["routing_replay"] == "off" and off["router_agreement"] == {}
    pair = json.loads(next(line for line in lines if '"pair"' in line))
    assert pair["matched_steps"] == 3 and pair["mismatch_off_minus_rollout"] == 0.02
    assert pair["step_s_rollout_minus_off"] == 0.5 and pair["rollout_no_replay_minus_replay"] == 0.015
    table = [line for line in lines if line.startswith("| ")]
    assert "| on | rollout | 3 | 2.50 | 0.20 | 0.930 | 0.0100 | 0.0250 | 0.300 | n/a | n/a |" in table
    assert "| off | off | 3 | 2.00 | 0.20 | n/a | 0.0300 | n/a | 0.300 | n/a | n/a |" in table
    assert (
        "| ?, median of 1 runs | rollout | 3 | 2.50 | 0.20 | 0.930 | 0.0100 | 0.0250 | 0.300 | n/a | n/a |"
        in table
    )
    assert len(json.loads((tmp_path / "s.json").read_text())["settings"]) == 2


def test_moe_mfu_table_names_each_cell_and_its_failure(tmp_path):
    """bench/gpu/moe_mfu.py: a row per cell with its experts, dispatcher and mode read from the variant name,
    the throughput against HF's, and a failed or skipped cell's reason in its row."""
    hf = {"results": {"hf": {"step_s": 0.25, "step_s_blocks": [0.24, 0.25, 0.26], "tokens_per_s": 64000.0,
                             "mfu": 0.226, "peak_mem_gib": 57.4, "warmup_s": 3.0}}}  # fmt: skip
    mega = {"world": 2, "ep": 2, "batch": 8, "seq": 2048, "n_params": 10, "n_params_total": 20, "steps": 4,
            "repeats": 3, "results": {
                "megatron_a2a": {"step_s": 0.2, "step_s_blocks": [0.19, 0.2, 0.22], "tokens_per_s": 80000.0,
                                 "mfu": 0.14, "peak_mem_gib": 40.0, "warmup_s": 5.0},
                "megatron_compile_seq": {"error": "skipped: past --budget-s 270"}}}  # fmt: skip
    for name, doc in (("hf", hf), ("mega", mega)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, "bench/gpu/moe_mfu.py", str(tmp_path / "hf.json"), str(tmp_path / "mega.json"),
                           "--out", str(tmp_path / "out.json")], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cells = {c["cell"]: c for c in json.loads((tmp_path / "out.json").read_text())["cells"]}
    a2a = cells["megatron_a2a"]
    assert (a2a["experts"], a2a["dispatcher"], a2a["mode"], a2a["gpus"]) == (
        "grouped",
        "alltoall",
        "eager",
        2,
    )
    assert a2a["throughput_vs_hf"] == 1.25 and (a2a["step_s_min"], a2a["step_s_max"]) == (0.19, 0.22)
    failed = cells["megatron_compile_seq"]
    assert (failed["experts"], failed["mode"]) == ("sequential", "compile") and "budget" in failed["error"]
    assert "| megatron_a2a | 2 (2) | grouped | alltoall | eager | 0.200 [0.190-0.220] | 80,000 | 14.0% |" in (
        proc.stdout
    )


def test_vlm_bench_smoke_on_cpu(tmp_path):
    """bench/gpu/vlm_bench.py's CPU smoke: the tiny VLM serves image+text requests twice (each run's tok/s and
    the median), and the log-prob check scores the sampled responses with the torch learner."""
    sys.path.insert(0, str(ROOT / "bench/gpu"))
    try:
        import vlm_bench
    finally:
        sys.path.remove(str(ROOT / "bench/gpu"))
    out = tmp_path / "vlm.json"
    result = vlm_bench.main(["--device", "cpu", "--arch", "tiny", "--n", "3", "--prompt-len", "4", "8",
                             "--output-len", "4", "8", "--no-sglang", "--runs", "2", "--check-logprobs", "2",
                             "--image-size", "56", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == result
    assert len(result["embedded"]["runs"]) == 2 and result["embedded"]["tok_s_median"] > 0
    assert result["image_tokens"] == 4  # 56 px: 4x4 patches, merged 2x2
    check = result["logprobs_vs_transformers"]
    assert check["requests"] == 2 and check["max"] <= 1e-4
