"""bench/published_runs.py (issue 38 item 5) runs on one row, so the table in docs/planner.md does not rot."""

from __future__ import annotations

import pytest

from tests.unit._source import bench_script

published_runs = bench_script("published_runs")


def test_published_tokens_follow_the_recipes_formula() -> None:
    run = next(r for r in published_runs.RUNS if r.key == "nemotron4-15b@64")
    # the recipe's own arithmetic: 4096 x 256 / 2.845 s = 368,568 tokens/s on 64 GPUs
    assert run.published_tokens_per_gpu == pytest.approx(368_568 / 64, rel=1e-4)


def test_one_row_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert published_runs.main(["--rows", "nemotron4-15b@64"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| nemotron4-15b@64 "))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2] == "5,759"
    te_ratio, engine_ratio = float(cells[4]), float(cells[7])
    # TE-class within 25 % of NeMo's published throughput; this engine slower than the TE-class stack
    assert 0.75 <= te_ratio <= 1.25
    assert 0 < engine_ratio < te_ratio
    # the engine's TP layout runs megatron-core's sequence parallelism, so it is no longer a reason it is slower
    assert cells[6].split(" (")[1].split()[1] == "sp", cells[6]
    assert "SP" not in cells[8]


def test_the_models_count_their_published_sizes() -> None:
    from stepdeploy.plan.params import count_parameters

    sizes = {"nemotron4-15b": 15.6e9, "llama3.1-70b": 70.6e9, "llama3.1-405b": 405.9e9, "grok1-314b": 316e9}
    for name, expected in sizes.items():
        run = next(r for r in published_runs.RUNS if r.model == name)
        total = count_parameters(published_runs.model_spec(name, run)).total
        assert total == pytest.approx(expected, rel=0.02), name


def test_unknown_row_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert published_runs.main(["--rows", "nope@8"]) == 2
    assert "known:" in capsys.readouterr().err
