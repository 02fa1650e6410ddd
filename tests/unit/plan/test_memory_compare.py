"""bench/memory_compare.py: Megatron's theoretical-memory formula and Korthikanti's Table 2, by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepdeploy.catalog import load_model
from tests.unit._source import bench_script

ROOT = Path(__file__).resolve().parents[3]
mc = bench_script("memory_compare")

DENSE = load_model("proxy-0.7b-dense")
SBH = 2048 * 1 * 2048  # s * b * h at micro-batch 1


def _shape(**changes: object) -> object:
    base = {"spec": DENSE, "seq": 2048, "mbs": 1, "tp": 1, "pp": 1, "vpp": 1, "dp": 2, "sp": False,
            "recompute": "none", "distributed_optimizer": True, "microbatches": 16}
    return mc.Shape(**(base | changes))


def test_megatron_parameter_count_by_hand() -> None:
    # per layer 2h(ffn + 1 norm) + 2h^2 (1 + groups/heads) = 2*2048*8193 + 4*2048^2; 12 layers, final norm,
    # two untied 2048 x 32768 tables
    layer = 2 * 2048 * 8193 + 4 * 2048**2
    assert mc.megatron_parameters_on_most_loaded_shard(DENSE, 1, 1) == 12 * layer + 2048 + 2 * 2048 * 32768
    assert mc.megatron_parameters_on_most_loaded_shard(DENSE, 1, 1) == 738_248_704


def test_megatron_weight_and_optimizer_bytes_18_or_6_plus_12_over_dp() -> None:
    assert mc.megatron_weight_and_optimizer_bytes(_shape()) == 738_248_704 * (6 + 12 / 2)
    assert mc.megatron_weight_and_optimizer_bytes(_shape(distributed_optimizer=False)) == 738_248_704 * 18


def test_megatron_activations_without_sp_by_hand() -> None:
    layers = SBH * (10 + 24) * 12  # sbh(10 + 24/t), t = 1
    embedding = 8 * 2048 + SBH  # embedding input + its dropout
    output = (2048 * 32768 + SBH) * 2  # bf16 logits and final-norm output
    expected = (layers + embedding + output) * 1.05
    assert mc.megatron_activation_bytes(_shape()) == pytest.approx(expected)
    assert mc.megatron_total_bytes(_shape()) == pytest.approx(738_248_704 * 12 + 1_950_997_708.8)


def test_megatron_activations_with_sp_and_selective_by_hand() -> None:
    shape = _shape(tp=2, sp=True, recompute="selective", dp=1)
    layers = SBH * (18 + 4 * 8192 / 2048) * 12
    embedding = 8 * 2048 + SBH
    output = SBH * 4 * (1 + 32768 / 2048)
    assert mc.megatron_activation_bytes(shape) == pytest.approx((layers + embedding + output) / 2)


def test_korthikanti_table_2_rows() -> None:
    a, s, h = 16, 2048, 2048
    scores = 5 * a * s / h  # 80
    assert mc.korthikanti_layer_bytes(s, 1, h, a, 1, False, "none") == SBH * (34 + scores) == 478_150_656
    assert mc.korthikanti_layer_bytes(s, 1, h, a, 2, False, "none") == SBH * (10 + 24 / 2 + scores / 2)
    assert mc.korthikanti_layer_bytes(s, 1, h, a, 2, True, "none") == SBH * (34 + scores) / 2
    assert mc.korthikanti_layer_bytes(s, 1, h, a, 2, False, "selective") == SBH * (10 + 24 / 2)
    assert mc.korthikanti_layer_bytes(s, 1, h, a, 2, True, "selective") == SBH * 34 / 2
    assert mc.korthikanti_layer_bytes(s, 1, h, a, 2, True, "full") == 2 * SBH / 2


def test_compare_reads_records_and_reports_errors(tmp_path: Path) -> None:
    measured = tmp_path / "memory.jsonl"
    record = {"name": "dense 1 GPU mbs 4", "model": "proxy-0.7b-dense", "gpus": 1, "layout": "mbs=4",
              "seq": 2048, "gbs": 32, "peak_gib": 20.78}
    measured.write_text(json.dumps(record) + "\n")
    out = tmp_path / "rows.json"
    assert mc.main(["--measured", str(measured), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["error"] == pytest.approx(row["predicted_gib"] / 20.78 - 1, abs=1e-4)
    assert row["megatron_gib"] == pytest.approx(mc.megatron_total_bytes(mc.shape_of(*mc.planner_estimate(record)[2:]))
                                                / 2**30, abs=1e-3)
    assert mc.main(["--measured", str(tmp_path / "missing.jsonl")]) == 2


def test_every_memtrace_phase_of_the_h200_runs_within_2_percent() -> None:
    """Component by component: model build = weights + grad buffer; optimizer build = + fp32 master; first
    forward-backward peak (no Adam m, v yet); state after the first step; the run's peak."""
    records = mc.read_records(ROOT / "tests/unit/plan/fixtures/h200-memtrace.jsonl")
    phases = mc.phase_rows([mc.compare(record) for record in records])
    assert len(phases) == 5 * len(records) == 40
    for item in phases:
        assert abs(item["error"]) <= 0.02, item
