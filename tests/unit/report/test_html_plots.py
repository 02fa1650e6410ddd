"""The HTML report and its PNGs: written next to each other, every ledger value escaped, no empty plot."""

from __future__ import annotations

import struct
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from stepdeploy.ledger import Ledger
from stepdeploy.report import read_run, summarise, write_report
from stepdeploy.report.html import render_html

from .conftest import T0, Clock

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = ["loss", "tokens", "rank_step_time", "memory", "timeline"]


def _write(run_dir: Path, html: Path) -> list[Path]:
    ledger = Ledger(run_dir / "ledger.sqlite")
    try:
        data = read_run(ledger, "r1")
    finally:
        ledger.close()
    return write_report(data, summarise(data), html, clock=lambda: T0 + 3600)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_report_files_and_plots(full_run: Path, tmp_path: Path) -> None:
    html = tmp_path / "out" / "report.html"
    written = _write(full_run, html)
    assert [p.name for p in written] == [f"report-{name}.png" for name in ALL_PLOTS] + ["report.html"]
    for png in written[:-1]:
        assert _png_size(png) == (1100, 396)  # 10 x 3.6 in at 110 dpi
        pixels = matplotlib.image.imread(png)[:, :, :3]
        rgb = (pixels * 255).astype(np.uint32)
        colours = np.unique((rgb[:, :, 0] << 16) | (rgb[:, :, 1] << 8) | rgb[:, :, 2])
        assert len(colours) > 50, f"{png.name} looks blank ({len(colours)} colours)"
        assert (pixels < 0.5).mean() > 0.003, f"{png.name} has almost no ink"
    text = html.read_text()
    for name in ALL_PLOTS:
        assert f'<img src="report-{name}.png"' in text


def test_html_shows_stages_verdicts_and_figures(full_run: Path, tmp_path: Path) -> None:
    html = tmp_path / "report.html"
    _write(full_run, html)
    text = html.read_text()
    for stage in ("warmup", "scale", "soak"):
        assert f'<tr class="stage"><td>{stage}</td>' in text
    assert text.count('<td class="fail">FAIL</td>') == 1 and text.count('<td class="pass">pass</td>') == 4
    assert '<td class="num">0.41</td><td class="num">0.7</td>' in text
    assert "<dt>steps</dt><dd>130 " in text and "<dt>peak memory</dt><dd>11.25 GiB</dd>" in text
    assert "25.0% <span class=\"muted\">(worst: scale/all-nodes, slowest rank 1)" in text


def test_hostile_event_message_is_escaped(full_run: Path, tmp_path: Path) -> None:
    html = tmp_path / "report.html"
    _write(full_run, html)
    text = html.read_text()
    assert "<script" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; rank 3 died [bold red]SIGKILL[/] $x$" in text


def test_every_ledger_value_is_escaped(tmp_path: Path) -> None:
    evil = '<img src=x onerror=alert(1)>"\''
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    clock = Clock()
    led = Ledger(run_dir / "ledger.sqlite", clock=clock)
    led.create_run("r1", {"model": evil}, ["warmup", evil])
    led.add_rungs("r1", "warmup", [(evil, {})])
    attempt = led.start_attempt("r1", "warmup", evil, {"note": evil})
    led.add_metrics("r1", attempt, [(T0 + 1, 0, 1, "loss", 1.0), (T0 + 2, 0, 2, "loss", 0.9)])
    clock.t += 5
    led.finish_attempt(attempt, "failed")
    led.verdict("r1", "warmup", evil, evil, False, measured={"x": evil}, threshold=evil, reason=evil)
    led.set_stage("r1", "warmup", "failed", reason=evil)
    led.event("r1", "$\\frac{$" + evil, evil, stage=evil, rung=evil)  # also not mathtext in the timeline
    led.close()
    _write(run_dir, tmp_path / "report.html")
    text = (tmp_path / "report.html").read_text()
    assert "<img src=x" not in text and "onerror=alert(1)>" not in text
    assert text.count("&lt;img src=x onerror=alert(1)&gt;&#34;&#39;") >= 8


def test_early_failure_draws_only_the_timeline(early_failure: Path, tmp_path: Path) -> None:
    written = _write(early_failure, tmp_path / "r.html")
    assert [p.name for p in written] == ["r-timeline.png", "r.html"]
    text = (tmp_path / "r.html").read_text()
    assert "<dt>final loss</dt><dd>n/a</dd>" in text and "No gate verdicts recorded." in text
    assert "rank 0 exited 1: ImportError: torch" in text


def test_render_html_is_pure(full_run: Path) -> None:
    ledger = Ledger(full_run / "ledger.sqlite")
    summary = summarise(read_run(ledger, "r1"))
    ledger.close()
    text = render_html(summary, [], generated=T0)
    assert "No data to plot." in text and "report generated 2023-11-14 22:13:20 UTC" in text


def test_many_ranks_are_drawn_as_a_band(tmp_path: Path) -> None:
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    clock = Clock()
    led = Ledger(run_dir / "ledger.sqlite", clock=clock)
    led.create_run("r1", {}, ["soak"])
    attempt = led.start_attempt("r1", "soak", "target", {})
    rows = [(T0 + it, rank, it, "rank_step_time_s", 1.0 + 0.01 * rank + (0.5 if rank == 33 else 0.0))
            for it in range(1, 50) for rank in range(64)]
    led.add_metrics("r1", attempt, rows)
    clock.t += 60
    led.finish_attempt(attempt, "passed")
    led.close()
    written = _write(run_dir, tmp_path / "many.html")
    assert [p.name for p in written] == ["many-rank_step_time.png", "many-timeline.png", "many.html"]
    ledger = Ledger(run_dir / "ledger.sqlite")
    figures = summarise(read_run(ledger, "r1")).figures
    ledger.close()
    assert figures.slowest_rank == 33 and figures.rank_skew == pytest.approx(0.83)  # (1.83 - 1.0) / 1.0
