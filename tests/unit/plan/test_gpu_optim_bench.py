"""bench/gpu_optim.sh's CPU part (`--summarize`: `stepdeploy plan --json` per layout and bench/optim_table.py's
table) on the runs the H200 recorded for docs/benchmarks.md "Optimizer offload (issue 22)" (fixtures/
h200-optim-runs: the fetched metrics.jsonl of `mbs=4` and of the offloaded layout; the fused AdamW never ran), and
shellcheck over the script and what it sources."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit._source import bench_script

ROOT = Path(__file__).resolve().parents[3]
RUNS = Path(__file__).parent / "fixtures" / "h200-optim-runs"
optim_table = bench_script("optim_table")


def test_the_scripts_are_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed; the README's test command installs it (apt-get install "
                    "shellcheck): a linter that is missing must fail, not skip")
    scripts = ["bench/gpu_optim.sh", "bench/gpu_box.sh", "bench/gpu_local.sh"]
    done = subprocess.run(["shellcheck", "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_summarize_compares_the_recorded_runs_with_the_plan(tmp_path: Path) -> None:
    for metrics in RUNS.iterdir():
        shutil.copy(metrics, tmp_path / metrics.name)
    for name in ("foreach", "offload"):
        (tmp_path / f"launch-{name}.log").write_text("h200 | [rank 0] exit 0: finished\nexit 0 after 50 s\n")
    # the recorded runs (2026-12-02) predate the fused RoPE: the plans they are compared with must not assume it
    layouts = ("foreach=mbs=4,rope-fusion=off fused=mbs=4,optimizer=fused,rope-fusion=off "
               "offload=mbs=4,offload=on,precision_aware_optimizer=on,rope-fusion=off")
    env = os.environ | {"PYTHON": sys.executable, "LAYOUTS": layouts}
    done = subprocess.run(["bash", "bench/gpu_optim.sh", "--summarize", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # the fused layout has no run: incomplete
    rows = {row["name"]: row for row in json.loads((tmp_path / "optim.json").read_text())["layouts"]}
    assert list(rows) == ["foreach", "fused", "offload"]
    foreach, offload = rows["foreach"], rows["offload"]
    assert foreach["measured"]["step_s"] == 0.6442 and foreach["measured"]["peak_gib"] == 21.78
    assert offload["measured"] == {"iterations": 15, "step_s": 1.1862, "optimizer_s": 0.5785, "peak_gib": 13.56,
                                   "last_loss": 10.30239}
    for row in (foreach, offload):
        assert row["exit"] == 0
        assert row["ratio"]["step"] == pytest.approx(1.0, abs=0.05)
        assert row["ratio"]["peak"] == pytest.approx(1.0, abs=0.05)
    assert offload["plan"]["optimizer_assumed"]["device"] == "host"
    assert rows["fused"]["measured"] is None and rows["fused"]["plan"]["optimizer_assumed"]["implementation"] == "fused"
    assert "| `mbs=4,optimizer=fused,rope-fusion=off` | fused on gpu | - | - |" in done.stdout


def test_summarize_without_a_directory_is_one_error_line(tmp_path: Path) -> None:
    done = subprocess.run(["bash", "bench/gpu_optim.sh", "--summarize", str(tmp_path / "none")], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1


def test_the_window_leaves_out_the_compiling_first_steps_and_a_cut_line(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics-x.jsonl"
    lines = [json.dumps({"iteration": i, "step_time_s": 16.5 if i == 1 else 1.0 + i / 100, "optimizer_s": 0.5,
                         "mem_peak_gib": 20.0 if i == 1 else 13.0, "loss": 10.0}) for i in range(1, 21)]
    metrics.write_text("\n".join(lines) + '\n{"iteration": 21, "step_ti')
    got = optim_table.measured(metrics, 6, 20)
    assert got is not None and got["iterations"] == 15 and got["step_s"] == pytest.approx(1.13)
    assert got["peak_gib"] == 20.0  # the peak is the run's, the first step's included
    assert optim_table.measured(tmp_path / "absent.jsonl", 6, 20) is None


def test_a_launch_log_without_its_exit_line_has_no_exit(tmp_path: Path) -> None:
    log = tmp_path / "launch.log"
    log.write_text("exit 0 after 50 s\n")
    assert optim_table.launch_exit(log) == 0
    log.write_text("exit 124 after 150 s\n")
    assert optim_table.launch_exit(log) == 124
    log.write_text("h200 | [rank 0] iter 20/20\n")
    assert optim_table.launch_exit(log) is None
