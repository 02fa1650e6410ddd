"""The Young/Daly checkpoint interval and the default MTBF from Llama 3's interruption rate."""

from __future__ import annotations

import json
import math

import pytest

from stepdeploy.plan import checkpoint


def test_young_is_the_square_root_of_twice_the_stall_times_the_mtbf() -> None:
    assert checkpoint.young_interval_s(50.0, 10_000.0) == 1000.0  # sqrt(2 * 50 * 10,000)
    assert checkpoint.young_interval_s(2.0, 9.0) == 6.0


@pytest.mark.parametrize(("mtbf_h", "expected_min"), [(24, 117), (6, 57), (0.25, 9.1)])
def test_daly_matches_his_published_examples(mtbf_h: float, expected_min: float) -> None:
    # Daly (2006), Figs. 3-5: a 5 min dump, M = 24 h, 6 h, 15 min -> tau_opt 117, 57, 9.1 min
    tau = checkpoint.daly_interval_s(300.0, mtbf_h * 3600.0)
    assert round(tau / 60.0, 1 if expected_min < 10 else 0) == expected_min


def test_daly_by_hand_and_its_limit() -> None:
    # delta 50, M 10,000: x = 0.0025, sqrt(x) = 0.05 -> 1000 * (1 + 0.05 / 3 + 0.0025 / 9) - 50
    assert checkpoint.daly_interval_s(50.0, 10_000.0) == pytest.approx(1000.0 * (1 + 0.05 / 3 + 0.0025 / 9) - 50.0)
    assert checkpoint.daly_interval_s(50.0, 10_000.0) == pytest.approx(966.9444444)
    assert checkpoint.daly_interval_s(300.0, 100.0) == 100.0  # a save longer than 2M: checkpoint every M


def test_the_default_mtbf_is_llama3s_per_gpu_rate_scaled_to_the_cluster() -> None:
    per_gpu = 54 * 86400 * 16384 / 419  # 182,437,208 s: ~5.8 years per GPU
    assert per_gpu == checkpoint.GPU_MTBF_S
    assert int(per_gpu) == 182_437_208
    assert checkpoint.default_mtbf_s(16_384) == pytest.approx(54 * 86400 / 419)  # Llama 3's own: one per 3.09 h
    assert checkpoint.default_mtbf_s(16) == pytest.approx(per_gpu / 16)  # a DGX pair: 3,167 h
    assert round(checkpoint.default_mtbf_s(16) / 3600) == 3167
    with pytest.raises(ValueError, match="at least one"):
        checkpoint.default_mtbf_s(0)


def test_checkpoint_size_per_node() -> None:
    # the Step-3.5-Flash slice: 3,437,421,824 parameters x 14 B = 48.1 GB, the size measured on the H200
    assert checkpoint.checkpoint_bytes_per_node(3_437_421_824, 1, 1) / 1e9 == pytest.approx(48.124, abs=1e-3)
    assert checkpoint.checkpoint_bytes_per_node(1_000, 8, 2) == 7_000  # megatron: spread over the nodes
    assert checkpoint.checkpoint_bytes_per_node(1_000, 0, 2) == 12_000  # torch engine: every node writes it all
    assert checkpoint.estimated_save_s(1.6e9) == 2.0  # 0.8 GB/s


def test_resolve_converts_tau_to_iterations() -> None:
    got = checkpoint.resolve(50.0, "measured", 2.0, "measured in the warm-up", 16, mtbf_s=10_000.0)
    assert (got.iterations, got.mtbf_source, got.gpus) == (483, "given (--mtbf)", 16)  # 966.94 s / 2 s
    assert got.young_s == 1000.0
    assert got.overhead == pytest.approx(50.0 / 966.0 + 966.0 / 20_000.0)
    assert "every 483 iteration(s)" in got.describe() and "measured in the warm-up" in got.describe()
    default = checkpoint.resolve(1.0, "estimated", 0.5, "predicted", 2)
    mtbf = checkpoint.GPU_MTBF_S / 2
    assert default.mtbf_s == mtbf and default.mtbf_source.startswith("Llama 3's rate")
    assert default.iterations == round(checkpoint.daly_interval_s(1.0, mtbf) / 0.5)
    assert default.iterations == round((math.sqrt(2 * mtbf) * (1 + math.sqrt(1 / (2 * mtbf)) / 3
                                                                + 1 / (2 * mtbf) / 9) - 1) / 0.5)


def test_at_least_one_iteration_and_positive_inputs() -> None:
    assert checkpoint.resolve(0.01, "m", 100.0, "s", 1, mtbf_s=1.0).iterations == 1
    with pytest.raises(ValueError, match="positive"):
        checkpoint.resolve(0.0, "m", 1.0, "s", 1)


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from stepdeploy.cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "-m", "proxy-0.7b-dense", "--nodes", "2", "--gpus-per-node", "8", "--gpu", "H200", *args])
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.out, captured.err


def test_plan_shows_the_interval_of_the_best_layout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan(capsys, "--top", "2", "--json")
    data = json.loads(out)
    best, interval = data["fitting"][0], data["checkpoint_interval"]
    assert code == 0 and interval["gpus"] == 16 and interval["step_s"] == best["step"]["seconds"]
    # 738,248,704 parameters x 14 B over 2 nodes, at 0.8 GB/s; Llama 3's rate for 16 GPUs
    assert interval["save_s"] == pytest.approx(738_248_704 * 14 / 2 / 0.8e9)
    assert interval["mtbf_s"] == pytest.approx(checkpoint.GPU_MTBF_S / 16)
    assert interval["iterations"] == round(checkpoint.daly_interval_s(interval["save_s"], interval["mtbf_s"])
                                           / interval["step_s"])
    code, out, _ = _plan(capsys, "--top", "2", "--mtbf", "6h", "--json")
    assert json.loads(out)["checkpoint_interval"]["mtbf_s"] == 21600.0
    code, out, _ = _plan(capsys, "--top", "2", "--layout", "tp=8,pp=1", "--mtbf", "6h")
    line = next(line for line in out.splitlines() if line.startswith("Checkpoint interval"))
    assert "the planner's step for tp=8" in line and "MTBF of 6 h for 16 GPU(s), given (--mtbf)" in line


def test_plan_refuses_a_bad_mtbf(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _plan(capsys, "--mtbf", "soon")
    assert code == 2 and out == "" and err.startswith("error: --mtbf duration 'soon' is not like 90s")
