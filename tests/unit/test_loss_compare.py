"""bench/loss_compare.py (issue 40): loss curves against a BASE run, judged against a rerun's noise. The script
runs as a real process on metrics.jsonl files written here; the expected figures are computed from the same data."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "loss_compare.py"


def compare(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def base_loss(i: int) -> float:
    return round(2 + 8 * math.exp(-i / 40), 5)


def write(path: Path, losses: dict[int, float], extra: Sequence[str] = ()) -> Path:
    """A metrics.jsonl as the workload writes it (loss rounded to 5 decimals), then the `extra` raw lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"iteration": i, "loss": round(loss, 5), "step_time_s": 0.5, "lr": 3e-4})
             for i, loss in losses.items()]
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path


def curve(offset: Callable[[int], float], iterations: range = range(1, 101)) -> dict[int, float]:
    """BASE's curve plus offset(i) at each iteration."""
    return {i: base_loss(i) + offset(i) for i in iterations}


def summary_line(out: str, label: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"  {label} ") and " n=" in line)


def verdict_line(out: str, label: str) -> str:
    lines = out.splitlines()
    after = lines[next(k for k, line in enumerate(lines) if line.startswith("verdict")):]
    return next(line for line in after if line.split()[:1] == [label])


def test_small_differences_within_twice_the_noise_pass(tmp_path: Path) -> None:
    base = write(tmp_path / "base.jsonl", curve(lambda i: 0.0))
    noise = write(tmp_path / "noise.jsonl", curve(lambda i: 0.001 if i % 2 else -0.001))  # mean = max = 0.001
    # mean 0.00117, max 0.0015: both under 2 x 0.001
    variant = write(tmp_path / "v.jsonl", curve(lambda i: 0.0015 if i % 3 else -0.0005))
    done = compare(base, variant, "--noise", noise, "--every", 25)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "within noise" in verdict_line(done.stdout, "v1")
    assert "outside noise" not in done.stdout
    assert "2 x the noise run's mean" in done.stdout  # the rule is stated
    table = done.stdout.split("\n\n")[1].splitlines()
    assert table[0].split() == ["iteration", "base", "v1", "v1-base", "noise", "noise-base"]
    assert [row.split()[0] for row in table[1:]] == ["25", "50", "75", "100"]
    row50 = table[2].split()
    assert row50[1:4] == [f"{base_loss(50):.5f}", f"{base_loss(50) + 0.0015:.5f}", "+0.00150"]


def test_a_divergence_is_outside_the_noise_and_its_worst_iteration_is_named(tmp_path: Path) -> None:
    base = write(tmp_path / "base.jsonl", curve(lambda i: 0.0))
    noise = write(tmp_path / "noise.jsonl", curve(lambda i: 0.001 if i % 2 else -0.001))
    fine = write(tmp_path / "fine.jsonl", curve(lambda i: -0.0012 if i % 2 else 0.0))

    def bump(i: int) -> float:  # a divergence between iterations 40 and 60 that peaks at 53
        return max(0.0, 0.05 - 0.004 * abs(i - 53)) if 40 <= i <= 60 else 0.0005

    bad = write(tmp_path / "bad.jsonl", curve(bump))
    diffs = {i: abs(round(base_loss(i) + bump(i), 5) - base_loss(i)) for i in range(1, 101)}
    worst = max(diffs, key=lambda i: diffs[i])
    assert worst == 53
    done = compare(base, fine, bad, "--noise", noise)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "within noise" in verdict_line(done.stdout, "v1")
    assert "outside noise" in verdict_line(done.stdout, "v2")
    assert f"max {diffs[worst]:.5f} at iteration {worst} " in summary_line(done.stdout, "v2")


def test_the_mean_alone_can_put_a_variant_outside(tmp_path: Path) -> None:
    base = write(tmp_path / "base.jsonl", curve(lambda i: 0.0))
    noise = write(tmp_path / "noise.jsonl", curve(lambda i: 0.001 if i == 30 else 0.0))  # mean 1e-5, max 1e-3
    steady = write(tmp_path / "v.jsonl", curve(lambda i: 0.0008))  # max under 2 x 1e-3, mean far over 2 x 1e-5
    done = compare(base, steady, "--noise", noise, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "outside noise"
    assert [b.split()[0] for b in report["variants"][0]["broke"]] == ["mean"]


def test_bad_lines_are_skipped_and_counted_and_a_redone_iteration_keeps_its_last_line(tmp_path: Path) -> None:
    base = write(tmp_path / "base.jsonl", curve(lambda i: 0.0, range(1, 21)))
    good = curve(lambda i: 0.0, range(1, 21))
    del good[5], good[6]  # only bad lines for these two
    good[3] = 99.0  # redone below
    bad = ["garbage{", "[1, 2]", '{"iteration": -1, "loss": 1.0}', '{"iteration": 5, "loss": NaN}',
           '{"iteration": 6, "loss": "3.0"}', "",
           json.dumps({"iteration": 3, "loss": base_loss(3) + 0.25}),  # the restart's line: kept
           json.dumps({"iteration": 7, "loss": base_loss(7) + 0.125, "profiled": True})]  # profiled: used
    variant = write(tmp_path / "v.jsonl", good, bad)
    done = compare(base, variant, "--json", "--every", 1)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    v1 = report["runs"]["v1"]
    assert (v1["skipped_lines"], v1["nonfinite_loss_lines"], v1["repeated_iterations"]) == (5, 1, 2)
    assert v1["iterations"] == 18 and report["runs"]["base"]["skipped_lines"] == 0
    rows = {row["iteration"]: row for row in report["rows"]}
    assert rows[3]["v1"] == pytest.approx(base_loss(3) + 0.25)
    assert rows[7]["v1"] == pytest.approx(base_loss(7) + 0.125)
    assert rows[5]["v1"] is None and rows[6]["v1"] is None
    summary = report["variants"][0]
    assert summary["n"] == 18
    assert (summary["max_abs_diff"], summary["max_abs_diff_iteration"]) == (pytest.approx(0.25), 3)
    text = compare(base, variant)
    assert text.returncode == 0
    assert "5 line(s) skipped (1 with a NaN/infinite loss), first: line 19: not JSON" in text.stdout


def test_a_directory_with_two_runs_needs_match(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    write(runs / "run-base" / "out" / "metrics.jsonl", curve(lambda i: 0.0))
    write(runs / "run-fast" / "out" / "metrics.jsonl", curve(lambda i: 0.5))
    variant = write(tmp_path / "v.jsonl", curve(lambda i: 0.002))
    done = compare(runs, variant)
    assert done.returncode == 2
    assert "--match" in done.stderr
    assert str(runs / "run-base" / "out" / "metrics.jsonl") in done.stderr
    assert str(runs / "run-fast" / "out" / "metrics.jsonl") in done.stderr
    for name, offset in (("run-base", 0.0), ("run-fast", 0.5)):
        done = compare(runs, variant, "--match", name, "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["runs"]["base"]["path"] == str(runs / name / "out" / "metrics.jsonl")
        assert report["variants"][0]["mean_abs_diff"] == pytest.approx(abs(0.002 - offset))


def test_bad_input_exits_2(tmp_path: Path) -> None:
    base = write(tmp_path / "base.jsonl", curve(lambda i: 0.0))
    unusable = tmp_path / "unusable.jsonl"
    unusable.write_text('not json\n{"iteration": 3}\n{"iteration": 4, "loss": NaN}\n')
    done = compare(base, unusable)
    assert done.returncode == 2 and str(unusable) in done.stderr and "no line" in done.stderr
    done = compare(base, tmp_path / "missing.jsonl")
    assert done.returncode == 2 and "missing.jsonl" in done.stderr
    done = compare(base, tmp_path, "--match", "nothing-like-this")
    assert done.returncode == 2 and "no **/out/metrics.jsonl" in done.stderr
    assert compare(base, base, "--every", 0).returncode == 2
    late = write(tmp_path / "late.jsonl", curve(lambda i: 0.0, range(200, 210)))
    assert compare(base, late).returncode == 2  # no iteration in common


def test_json_reports_the_figures_of_the_files(tmp_path: Path) -> None:
    rng = random.Random(40)
    start = 10
    losses = {"base": curve(lambda i: 0.0, range(0, 51)),
              "v1": curve(lambda i: rng.uniform(-0.01, 0.01), range(0, 46)),
              "noise": curve(lambda i: rng.uniform(-0.006, 0.006), range(0, 51))}
    paths = {label: write(tmp_path / f"{label}.jsonl", data) for label, data in losses.items()}
    done = compare(paths["base"], paths["v1"], "--noise", paths["noise"], "--from", start, "--json")
    report = json.loads(done.stdout)

    def expected(label: str) -> dict[str, Any]:
        written = {i: round(x, 5) for i, x in losses[label].items()}
        base = {i: round(x, 5) for i, x in losses["base"].items()}
        common = [i for i in sorted(base) if i >= start and i in written]
        diffs = {i: abs(written[i] - base[i]) for i in common}
        worst = max(common, key=lambda i: diffs[i])
        return {"n": len(common), "mean_abs_diff": statistics.fmean(diffs.values()), "max_abs_diff": diffs[worst],
                "max_abs_diff_iteration": worst, "final_iteration": common[-1], "final_base": base[common[-1]],
                "final_variant": written[common[-1]]}

    v1, noise = expected("v1"), expected("noise")
    assert v1["n"] == 36 and v1["final_iteration"] == 45
    got = report["variants"][0]
    assert {k: got[k] for k in v1} == pytest.approx(v1)
    assert {k: report["noise"][k] for k in noise} == pytest.approx(noise)
    within = v1["mean_abs_diff"] <= 2 * noise["mean_abs_diff"] and v1["max_abs_diff"] <= 2 * noise["max_abs_diff"]
    assert got["verdict"] == report["verdict"] == ("within noise" if within else "outside noise")
    assert done.returncode == (0 if within else 1)
    assert report["from"] == start and "2 x the noise run's max" in report["rule"]


def test_without_noise_there_is_no_verdict(tmp_path: Path) -> None:
    base = write(tmp_path / "base.jsonl", curve(lambda i: 0.0))
    variant = write(tmp_path / "v.jsonl", curve(lambda i: 0.5))  # far off, yet nothing to judge it against
    done = compare(base, variant)
    assert done.returncode == 0
    assert "no noise run given: no verdict" in done.stdout
    assert "within noise" not in done.stdout and "outside noise" not in done.stdout


def test_plot_writes_a_png(tmp_path: Path) -> None:
    base = write(tmp_path / "base.jsonl", curve(lambda i: 0.0))
    noise = write(tmp_path / "noise.jsonl", curve(lambda i: 0.001 if i % 2 else -0.001))
    variant = write(tmp_path / "v.jsonl", curve(lambda i: 0.0015 if i % 3 else 0.0))
    png = tmp_path / "loss.png"
    done = compare(base, variant, "--noise", noise, "--from", 20, "--plot", png)
    assert done.returncode == 0, done.stdout + done.stderr
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
