"""Restart time and goodput on paper (issue 37 item 5): the model's arithmetic against a hand computation, its
monotonicity, and what `stepdeploy plan` shows of it (text and --json)."""

from __future__ import annotations

import json
import math

import pytest

from stepdeploy.cli.app import main
from stepdeploy.plan import restart
from stepdeploy.plan.checkpoint import GPU_MTBF_S

DENSE_PARAMS = 738_248_704
DENSE_STATE = DENSE_PARAMS * 14  # bf16 weights + fp32 master, m, v on one GPU: 10.3 GB (9.6 GiB)


def test_one_gpu_restart_by_hand() -> None:
    # the dense proxy on one GPU, its step 0.645 s, a 12.9 s save
    got = restart.estimate(1, 1, DENSE_PARAMS, DENSE_STATE, 0.645, 12.9)
    by_hand = {
        "detection": 0.7, "stop": 0.2, "launch": 0.11,
        "imports_and_process_group": 1.32 + 0.001 * 1,
        "model_build": 2.68 + 0.021 * DENSE_PARAMS / 1e9,  # 2.70 s: the measured builds were 2.66-2.72 s (BB)
        "state_restore": DENSE_STATE / 12.2e9,  # 0.85 s: the measured loads were 0.91-0.95 s (BB)
        "first_step": 0.645 + 1.0,
    }
    assert got.parts == pytest.approx(by_hand)
    assert got.restart_s == pytest.approx(sum(by_hand.values()))
    # measured with the local executor (detection 0.56 s): 7.26 s, the median of 3 kills (call BB, an H100)
    assert got.restart_s - 0.7 + 0.56 == pytest.approx(7.26, rel=0.05)
    mtbf = 54 * 86400 * 16384 / 419
    assert got.mtbf_s == pytest.approx(mtbf)
    young = math.sqrt(2 * 12.9 * mtbf)
    x = 12.9 / (2 * mtbf)
    tau = young * (1 + math.sqrt(x) / 3 + x / 9) - 12.9
    assert got.interval_s == pytest.approx(tau)
    lost = 12.9 / tau + tau / (2 * mtbf) + got.restart_s / mtbf
    assert got.goodput == pytest.approx(1 - lost)
    assert got.failures_per_day == pytest.approx(86400 / mtbf)


def test_node_read_is_shared_by_its_gpus() -> None:
    parts = restart.restart_parts(64, 8, 1e9, 25e9, 1.0)
    assert parts["state_restore"] == pytest.approx(25e9 / min(12.2e9, 12.5e9 / 8))
    assert parts["imports_and_process_group"] == pytest.approx(1.32 + 0.064)


def test_given_interval_and_mtbf_are_used() -> None:
    got = restart.estimate(2, 8, 1e9, 14e9, 1.0, 10.0, mtbf_s=3600.0, interval_s=600.0)
    assert got.interval_s == 600.0 and got.mtbf_s == 3600.0
    assert got.lost == pytest.approx({"saves": 10 / 600, "redone": 600 / 7200, "restarts": got.restart_s / 3600})


def test_more_gpus_fail_more_and_lose_more() -> None:
    goodputs, failures = [], []
    for nodes in (1, 16, 128, 1024, 2048):
        got = restart.estimate(nodes, 8, 5e9, 40e9, 2.0, 20.0)
        goodputs.append(got.goodput)
        failures.append(got.failures_per_day)
        assert got.failures_per_day == pytest.approx(86400 * nodes * 8 / GPU_MTBF_S)
    assert failures == sorted(failures) and len(set(failures)) == len(failures)
    assert goodputs == sorted(goodputs, reverse=True) and len(set(goodputs)) == len(goodputs)


def test_layout_estimates_cover_the_target_scales_and_shrink_the_optimizer_shard() -> None:
    got = restart.layout_estimates(10_000_000_000, 2e9, 12e9, True, 2, 8, 1.0)
    assert [e.nodes for e in got] == [2, 16, 1024]
    assert got[0].state_bytes_per_gpu == pytest.approx(14e9)
    assert got[1].state_bytes_per_gpu == pytest.approx(2e9 + 12e9 * 2 / 16)
    assert got[0].goodput > got[1].goodput > got[2].goodput
    fixed = restart.layout_estimates(10_000_000_000, 2e9, 12e9, False, 2, 8, 1.0)
    assert {e.state_bytes_per_gpu for e in fixed} == {14e9}


def test_a_given_mtbf_is_scaled_to_the_other_scales() -> None:
    got = restart.layout_estimates(1_000_000_000, 2e9, 12e9, True, 2, 8, 1.0, mtbf_s=6 * 3600.0)
    assert got[0].mtbf_s == pytest.approx(6 * 3600.0)
    assert got[1].mtbf_s == pytest.approx(6 * 3600.0 * 2 / 16)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        restart.restart_parts(0, 8, 1e9, 1e9, 1.0)
    with pytest.raises(ValueError):
        restart.lost_fractions(10.0, 1.0, 0.0, 100.0)


CLUSTER = ("--nodes", "2", "--gpus-per-node", "8", "--gpu", "H200", "--link", "ib-400g")


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "-m", "proxy-0.7b-dense", *CLUSTER, *args])
    return int(exit_info.value.code or 0), capsys.readouterr().out


def test_plan_prints_the_estimate_and_its_assumptions(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _plan(capsys)
    assert code == 0
    assert "Restart and goodput on paper" in out
    for scale in ("2 x 8 GPUs", "16 x 8 GPUs", "1024 x 8 GPUs"):
        assert f"  - {scale}: restart " in out
    assert "assuming:" in out and "419 unexpected interruptions" in out and "process group 1 ms per rank" in out
    assert "not modelled, so low for a GPU that is nearly full" in out  # the slice's 17.9 s against 11.2 s


def test_plan_json_has_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _plan(capsys, "--json")
    assert code == 0
    data = json.loads(out)["restart"]
    assert [e["gpus"] for e in data["estimates"]] == [16, 128, 8192]
    first = data["estimates"][0]
    assert first["restart_s"] == pytest.approx(sum(first["parts"].values()))
    assert first["goodput"] == pytest.approx(1 - sum(first["lost"].values()))
    goodputs = [e["goodput"] for e in data["estimates"]]
    assert goodputs == sorted(goodputs, reverse=True)
    assert data["assumptions"] and all(isinstance(a, str) for a in data["assumptions"])
