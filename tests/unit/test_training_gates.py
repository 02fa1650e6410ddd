"""The soak's training gates (rollout/training_gates.py) on given metrics: each passes what a healthy run looks
like and fails what the issue saw (a flat loss from a ~0 learning rate) or what breaks training."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from stepdeploy.rollout.attempt import metric_rows
from stepdeploy.rollout.gates import Thresholds
from stepdeploy.rollout.training_gates import (
    expert_load,
    grad_norm_range,
    kept,
    loss_spikes,
    loss_trend,
    soak_training_gates,
)

T = Thresholds()
FIXTURES = Path(__file__).parents[1] / "fixtures" / "soak"


def run(losses: list[float], **extra: list) -> list[dict]:
    lines = [{"iteration": i + 1, "loss": loss, "grad_norm": 1.0} for i, loss in enumerate(losses)]
    for key, values in extra.items():
        for line, value in zip(lines, values, strict=True):
            line[key] = value
    return lines


def noisy_falling(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [6.0 * math.exp(-i / 200) + 2.0 + rng.gauss(0, 0.02) for i in range(n)]


def test_the_loss_must_fall_after_warmup_and_a_flat_one_fails_a_short_soak() -> None:
    falling = loss_trend(run(noisy_falling(100)), warmup=5, t=T)
    assert falling.passed and falling.measured["first"] > falling.measured["last"]
    flat = loss_trend(run([10.80] * 100), warmup=5, t=T)  # the soak: lr 5e-11, loss stuck at 10.80
    assert not flat.passed and "learning rate ~0" in flat.reason
    few = loss_trend(run([3.0, 2.0, 1.0, 0.5]), warmup=1, t=T)
    assert not few.passed and "too few" in few.reason


def test_a_long_soak_may_plateau_within_the_bound_but_not_rise() -> None:
    n = T.long_soak_iterations + 10
    assert loss_trend(run([2.0 + 0.01 * (i % 2) for i in range(n)]), warmup=0, t=T).passed
    rising = loss_trend(run([2.0 + 0.5 * i / n for i in range(n)]), warmup=0, t=T)
    assert not rising.passed and "rose" in rising.reason


def test_warmup_iterations_are_left_out_of_the_trend() -> None:
    # falls in warm-up only, then flat: not training after warm-up
    losses = [10.0 - i for i in range(8)] + [2.0] * 40
    assert loss_trend(run(losses), warmup=0, t=T).passed
    assert not loss_trend(run(losses), warmup=8, t=T).passed


def test_a_spike_above_the_running_median_is_found_and_noise_is_not() -> None:
    losses = noisy_falling(120)
    assert loss_spikes(run(losses), warmup=5, t=T).measured["count"] == 0
    losses[80] = losses[79] * 1.5
    spiked = loss_spikes(run(losses), warmup=5, t=T)
    assert not spiked.passed and [s["iteration"] for s in spiked.measured["spikes"]] == [81]
    # a spike inside the warm-up is not judged
    assert loss_spikes(run(losses), warmup=100, t=T).passed


def test_a_noisy_run_is_judged_against_its_noise_not_a_quiet_stretch_of_it() -> None:
    # Recorded on the simulated cluster (tiny-dense, 256 tokens a step: noise ~0.17 around 6.2): eight of the
    # twenty losses before iteration 284 lay within 0.07 of each other, and a MAD of those twenty alone read
    # 6.530 vs 6.173 as z = 6 -- a spike that was noise. The run's noise comes from its step-to-step changes.
    recorded = json.loads((FIXTURES / "tiny_dense_kill_losses.json").read_text())
    losses, warmup = recorded["loss"], recorded["warmup"]
    assert loss_spikes(run(losses), warmup=warmup, t=T).passed
    spiked = list(losses)
    spiked[199] *= 1.3  # a real spike in the same noise: 30 %, z ~ 10
    bad = loss_spikes(run(spiked), warmup=warmup, t=T)
    assert not bad.passed and [s["iteration"] for s in bad.measured["spikes"]] == [200]


# The gradient norms of the Step-3.5-Flash slice's soak on one H200 (H200 call P, docs/benchmarks.md): from a
# fresh start they fall from ~150 to ~1.5; lr warm-up 6 iterations.
H200_SLICE_NORMS = [
    55.64, 149.21, 91.49, 36.77, 57.17, 80.82, 69.24, 40.59, 34.63, 29.29, 22.64, 55.23, 30.52, 21.19, 13.72, 40.44,
    55.05, 48.16, 15.65, 22.9, 11.03, 11.06, 14.06, 11.4, 7.53, 11.55, 7.65, 6.76, 7.62, 6.68, 6.89, 5.66, 5.55,
    5.08, 3.76, 4.92, 5.42, 4.23, 7.33, 5.14, 5.07, 7.34, 6.81, 3.91, 5.64, 4.79, 4.9, 3.1, 3.38, 3.31, 3.37, 5.13,
    4.13, 2.57, 3.84, 3.78, 3.41, 4.6, 3.6, 4.14, 2.47, 3.64, 4.04, 3.41, 4.53, 3.49, 3.45, 2.13, 3.2, 3.15, 5.21,
    2.96, 5.89, 4.83, 4.54, 4.4, 3.54, 3.67, 3.31, 3.11, 2.98, 3.33, 4.99, 3.34, 4.1, 4.62, 1.79, 3.52, 3.06, 3.43,
    2.33, 3.04, 3.21, 3.15, 2.03, 1.98, 1.59, 1.29, 2.04, 2.02, 1.56, 1.82, 1.92, 2.04, 1.39, 1.84, 1.79, 1.91, 2.12,
    1.88, 1.47, 1.45, 1.77, 1.55, 1.33, 1.56, 1.33]


# ... and the dense proxy's soak through the local executor (H200 call R): from a fresh start they rise from 0.3 to
# 10 by step 40 (lr warm-up 6 iterations), then fall.
H200_DENSE_NORMS = [
    2.42, 1.54, 0.92, 0.6, 0.43, 0.38, 0.83, 0.52, 0.55, 0.31, 0.29, 0.27, 0.27, 0.41, 0.44, 0.32, 0.56, 1.44, 0.67,
    1.47, 0.91, 2.3, 4.02, 2.71, 4.03, 4.97, 5.97, 7.2, 7.43, 8.43, 8.57, 9.04, 9.22, 9.53, 9.72, 9.63, 9.65, 9.22,
    10.1, 9.69, 9.97, 9.77, 9.65, 9.28, 8.66, 8.3, 7.99, 8.11, 8.1, 8.75, 8.26, 8.35, 8.98, 9.07, 7.45, 9.03, 8.01,
    7.36, 5.78, 6.32, 5.81, 5.74, 6.1, 5.77, 5.51, 5.13, 5.34, 4.69, 5.25]


def test_gradient_norms_moving_tenfold_from_a_fresh_start_pass_and_a_sudden_jump_fails() -> None:
    for norms in (H200_SLICE_NORMS, H200_DENSE_NORMS):
        ok = grad_norm_range(run([2.0] * len(norms), grad_norm=norms), warmup=6, t=T)
        assert ok.passed, ok.reason  # the slice's largest is 18x the soak's median, the dense's last 18x its first
        assert ok.measured["max"] == max(norms[6:]) and ok.measured["spikes"] == []
    jumped = list(H200_SLICE_NORMS)
    jumped[90] = 60.0  # one step at 10.2x the largest of the 20 before it (5.89)
    bad = grad_norm_range(run([2.0] * len(jumped), grad_norm=jumped), warmup=6, t=T)
    assert not bad.passed and [s["iteration"] for s in bad.measured["spikes"]] == [91]
    assert "first at iteration 91 (60 vs 5.89)" in bad.reason
    steady = [1.0 + 0.1 * (i % 3) for i in range(60)]
    assert grad_norm_range(run([2.0] * 60, grad_norm=steady), warmup=3, t=T).passed
    nonfinite = grad_norm_range(run([2.0] * 4, grad_norm=[1.0, math.inf, 1.0, 1.0]), warmup=0, t=T)
    assert not nonfinite.passed and nonfinite.reason == "non-finite gradient norm at iteration 2"


def test_expert_load_dropped_tokens_and_router_bias_after_warmup() -> None:
    lines = run([2.0] * 30, moe_load_max=[9.0] * 5 + [1.6] * 25, moe_dropped=[0.0] * 30,
                router_bias_absmax=[0.001 * i for i in range(30)])
    verdicts = {v.gate: v for v in expert_load(lines, warmup=5, t=T)}
    assert all(v.passed for v in verdicts.values()) and verdicts["expert_load"].measured["median"] == 1.6
    assert verdicts["router_bias"].measured == 0.029
    settling = run([2.0] * 30, moe_load_max=[9.0] * 20 + [1.6] * 10)  # balanced only once warm-up is over
    assert expert_load(settling, warmup=20, t=T)[0].passed and not expert_load(settling, warmup=0, t=T)[0].passed
    skewed = run([2.0] * 30, moe_load_max=[6.0] * 30, moe_dropped=[0.0] * 29 + [0.01],
                 router_bias_absmax=[2.0] * 30)
    failed = {v.gate for v in expert_load(skewed, warmup=5, t=T) if not v.passed}
    assert failed == {"expert_load", "tokens_dropped", "router_bias"}
    assert expert_load(run([2.0] * 30), warmup=5, t=T) == []  # a dense model
    # the H200 slice's soak (32 experts, 8 per token: a ceiling of 4): the busiest expert of the worst layer took
    # every token from step 3 on; under max_expert_load, yet collapsed
    collapsed = run([2.0] * 30, moe_load_max=[2.68, 3.99] + [4.0] * 28, moe_load_ceiling=[4.0] * 30)
    [verdict] = [v for v in expert_load(collapsed, warmup=6, t=T) if v.gate == "expert_load"]
    assert not verdict.passed and verdict.measured["share"] == 1.0 and "collapsed" in verdict.reason
    spread = run([2.0] * 30, moe_load_max=[1.6] * 30, moe_load_ceiling=[4.0] * 30)
    assert next(v for v in expert_load(spread, warmup=6, t=T) if v.gate == "expert_load").passed


def test_redone_iterations_count_once_as_their_last_run() -> None:
    # killed at 12, resumed from the checkpoint at 10: iterations 11 and 12 ran twice
    first = run([5.0 - 0.1 * i for i in range(12)])
    first[-1]["loss"] = math.nan  # the killed attempt's last line
    again = [{"iteration": i, "loss": 5.0 - 0.1 * (i - 1), "grad_norm": 1.0} for i in range(11, 31)]
    lines = kept(first + again)
    assert [m["iteration"] for m in lines] == list(range(1, 31)) and not math.isnan(lines[11]["loss"])
    assert all(v.passed for v in soak_training_gates(first + again, warmup=2, t=T))


def test_per_layer_metrics_reach_the_ledger_as_named_rows() -> None:
    line = {"iteration": 7, "time": 100.0, "loss": 2.0, "moe_load_max": 1.5, "moe_load": {"2": 1.2, "3": 1.5},
            "router_bias": {"2": 0.01}, "mtp_loss": [2.5]}
    rows = {(name, value) for _ts, _rank, _it, name, value in metric_rows([line], ("loss", "moe_load_max"))}
    assert rows == {("loss", 2.0), ("moe_load_max", 1.5), ("moe_load/2", 1.2), ("moe_load/3", 1.5),
                    ("router_bias/2", 0.01), ("mtp_loss/1", 2.5)}


def test_expert_load_names_the_layers_whose_own_median_is_over() -> None:
    """The H200 MoE proxy's soak (call AJ): the worst layer was at the ceiling every step, but only some layers
    stayed there; the verdict names them by their own medians, worst first."""
    loads = [{"1": 1.4, "2": 2.2 + 0.01 * i, "3": 4.0, "4": 3.9 if i < 20 else 2.0} for i in range(30)]
    lines = run([2.0] * 30, moe_load_max=[4.0] * 30, moe_load_ceiling=[4.0] * 30, moe_load=loads)
    [verdict] = [v for v in expert_load(lines, warmup=5, t=T) if v.gate == "expert_load"]
    assert not verdict.passed and verdict.measured["layers"] == 4 and verdict.measured["layers_over"] == 2
    assert "2 of 4 layer(s) above 3.6: layer 3 4.00, layer 4 3.90" in verdict.reason
    balanced = run([2.0] * 30, moe_load_max=[1.8] * 30, moe_load_ceiling=[4.0] * 30,
                   moe_load=[{"1": 1.5, "2": 1.8}] * 30)
    [ok] = [v for v in expert_load(balanced, warmup=5, t=T) if v.gate == "expert_load"]
    assert ok.passed and "no layer's own median above 3.6 (of 2)" in ok.reason
    assert "layers" not in expert_load(run([2.0] * 30, moe_load_max=[1.8] * 30), warmup=5, t=T)[0].measured
