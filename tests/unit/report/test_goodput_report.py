"""The report's Goodput section (terminal, JSON, HTML) and the plots of the per-step training metrics, from a
ledger written with the real Ledger API: an MoE soak with learning rate, gradient norm, expert load (max and per
layer), router bias, two MTP depths, its resolved auto checkpoint interval and its goodput event."""

from __future__ import annotations

import io
import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from stepdeploy.ledger import Ledger
from stepdeploy.report import read_run, renderables, summarise, write_report
from stepdeploy.report.summary import RunData, goodput_rows
from stepdeploy.rollout.goodput import breakdown

from .conftest import T0, Clock
from .test_report_cli import _app

TRAINING_PLOTS = ["loss", "tokens", "lr", "grad_norm", "moe_load", "moe_aux_loss", "router_bias", "mtp_loss",
                  "timeline", "goodput"]


def _goodput_data() -> dict:
    # soak T0 -> T0 + 50, launched at T0 + 1; process start T0 + 2, group up + 3, model + 4, nothing to resume
    # + 4.5; first step 3 s ends + 7.5, 19 steps of 2 s end at + 45.5; a save of 1 s
    phases = [{"phase": "start", "time": T0 + 2, "pid": 9}, {"phase": "initialized", "time": T0 + 3, "pid": 9},
              {"phase": "model", "time": T0 + 4, "pid": 9},
              {"phase": "resumed", "time": T0 + 4.5, "pid": 9, "iteration": 0, "load_s": 0.0},
              {"phase": "first_step", "time": T0 + 7.5, "pid": 9, "iteration": 1, "step_s": 3.0},
              {"phase": "save", "time": T0 + 31, "pid": 9, "iteration": 10, "began": T0 + 30}]
    lines = [{"iteration": it, "step_time_s": 3.0 if it == 1 else 2.0, "time": T0 + 7.5 + 2 * (it - 1)}
             for it in range(1, 21)]
    return breakdown(T0, T0 + 50, lines, phases, [{"started": T0 + 1}], []).to_json()


def build_moe_soak(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    led = Ledger(run_dir / "ledger.sqlite", clock=clock)
    led.create_run("r1", {"model": "tiny-moe", "checkpoint_interval": "auto"}, ["soak"])
    led.set_stage("r1", "soak", "running")
    led.event("r1", "checkpoint", "checkpoint interval (auto): every 7 iteration(s)", stage="soak",
              data={"iterations": 7, "describe": "every 7 iteration(s) (Young/Daly tau 14 s)"})
    attempt = led.start_attempt("r1", "soak", "target", {"rung": {"model": "tiny-moe"}})
    rows = []
    for it in range(1, 21):
        ts = T0 + 7.5 + 2 * (it - 1)
        rows += [(ts, 0, it, "loss", 6.0 - 0.05 * it), (ts, 0, it, "tokens_per_s", 900.0),
                 (ts, 0, it, "step_time_s", 2.0), (ts, 0, it, "lr", 1e-3 * min(it, 5) / 5),
                 (ts, 0, it, "grad_norm", 1.0 + 0.02 * it), (ts, 0, it, "moe_load_max", 1.6 - 0.01 * it),
                 (ts, 0, it, "moe_load/0", 1.2), (ts, 0, it, "moe_load/1", 1.6 - 0.01 * it),
                 (ts, 0, it, "moe_aux_loss_mean", 1.3 - 0.01 * it), (ts, 0, it, "moe_aux_loss/1", 1.3 - 0.01 * it),
                 (ts, 0, it, "router_bias_absmax", 0.002 * it), (ts, 0, it, "mtp_loss/1", 6.2 - 0.05 * it),
                 (ts, 0, it, "mtp_loss/2", 6.4 - 0.04 * it)]
    led.add_metrics("r1", attempt, rows)
    clock.t = T0 + 50
    led.finish_attempt(attempt, "passed")
    led.event("r1", "goodput", "goodput 80.0% of 50 s", stage="soak", data=_goodput_data())
    led.set_stage("r1", "soak", "passed")
    led.set_run_status("r1", "passed")
    led.close()
    return run_dir


@pytest.fixture
def moe_soak(tmp_path: Path) -> Path:
    return build_moe_soak(tmp_path / "moe" / "r1")


def _read(run_dir: Path) -> RunData:
    ledger = Ledger(run_dir / "ledger.sqlite")
    try:
        return read_run(ledger, "r1")
    finally:
        ledger.close()


def test_the_summary_carries_the_goodput_and_the_interval(moe_soak: Path) -> None:
    data = _read(moe_soak)
    assert {"moe_load/0", "moe_load/1", "mtp_loss/1", "mtp_loss/2"} <= set(data.metrics)
    summary = summarise(data)
    assert summary.goodput is not None and summary.goodput["ratio"] == 0.8
    assert summary.checkpoint_interval == {"iterations": 7, "describe": "every 7 iteration(s) (Young/Daly tau 14 s)"}
    assert [e["kind"] for e in summary.notable_events()] == []  # goodput and checkpoint are informational
    # productive 2 + 19 x 2 = 40; start-up 2 + 1 + 1 + 0.5 + 1 (the first step's extra); a 1 s save; other 3.5
    assert goodput_rows(summary.goodput) == [
        ("productive", 40.0, 0.8, "20 iterations that count; steady step 2 s"),
        ("start-up", 5.5, 0.11, "1 start(s): launch 2.0 s, imports + process group 1.0 s, model build 1.0 s, "
                                "checkpoint load 0.5 s, first step extra 1.0 s"),
        ("checkpoint saves", 1.0, 0.02, "1 save(s), the longest 1 s"),
        ("failures", 0.0, 0.0, "0 failure(s): none"),
        ("redone iterations", 0.0, 0.0, "0 iteration(s) a restart threw away"),
        ("other", 3.5, 0.07, "between steps, polls, the soak's end")]


def test_terminal_goodput_section(moe_soak: Path, full_run: Path) -> None:
    buffer = io.StringIO()
    Console(file=buffer, width=220, color_system=None).print(renderables(summarise(_read(moe_soak))))
    text = buffer.getvalue()
    assert "Goodput: 80.0% effective training time (productive step time over the soak's wall time, 50.0 s)" in text
    start_up = next(line for line in text.splitlines() if "│ start-up" in line)
    assert "5.5 s" in start_up and "11.0%" in start_up and "checkpoint load 0.5 s" in start_up
    assert "checkpoint interval (auto): every 7 iteration(s)" in text
    buffer = io.StringIO()
    Console(file=buffer, width=220, color_system=None).print(renderables(summarise(_read(full_run))))
    assert "Goodput: n/a (recorded when a soak ends)" in buffer.getvalue()


def test_json_has_the_goodput(moe_soak: Path) -> None:
    result = CliRunner().invoke(_app(), [str(moe_soak), "--json"])
    assert result.exit_code == 0, result.output
    goodput = json.loads(result.stdout)["goodput"]
    assert goodput["ratio"] == 0.8 and goodput["parts"]["startup"] == 5.5 and goodput["saves"] == 1
    assert goodput["startup_parts"]["launch"] == 2.0


def test_html_goodput_and_training_plots(moe_soak: Path, tmp_path: Path) -> None:
    data = _read(moe_soak)
    html = tmp_path / "report.html"
    written = write_report(data, summarise(data), html, clock=lambda: T0 + 3600)
    assert [p.name for p in written] == [f"report-{name}.png" for name in TRAINING_PLOTS] + ["report.html"]
    for png in written[:-1]:
        pixels = matplotlib.image.imread(png)[:, :, :3]
        assert pixels.shape[:2] == (396, 1100), png.name
        rgb = (pixels * 255).astype(np.uint32)
        assert len(np.unique((rgb[:, :, 0] << 16) | (rgb[:, :, 1] << 8) | rgb[:, :, 2])) > 50, png.name
    text = html.read_text()
    assert "<h2>Goodput</h2>" in text and "<p>Goodput: 80.0% effective training time" in text
    assert '<tr><td>start-up</td><td class="num">5.5 s</td><td class="num">11.0%</td>' in text
    assert "checkpoint interval (auto): every 7 iteration(s)" in text
    for name in TRAINING_PLOTS:
        assert f'<img src="report-{name}.png"' in text
