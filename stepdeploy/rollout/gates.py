"""Stage gates: pure judgements over a stage attempt's outcome and its metrics (values in, verdicts out).

Every verdict carries the measured value, the threshold and a sentence, so the ledger and the report can
say exactly why a rollout advanced or stopped.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Thresholds:
    """Gate thresholds; the defaults are documented in docs/rollout.md."""

    # read back from a ledger: no unknown keys, no NaN/inf (rollout.config.RolloutConfig.from_json)
    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid", "allow_inf_nan": False}

    min_scaling_efficiency: float = 0.7  # per-GPU throughput vs the previous rung of the same model
    min_mfu_vs_plan: float = 0.7  # a rung that changes the model: its MFU vs the planner's prediction
    memory_tolerance: float = 0.15  # measured peak vs the plan's prediction, either way
    loss_window: int = 3  # iterations averaged at the start and the end to call the loss "falling"
    max_step_time_s: float | None = None  # optional ceiling on the steady step time
    # the soak's training gates (rollout/training_gates.py)
    trend_window_fraction: float = 0.1  # loss trend: windows of this share of the iterations after warm-up
    max_loss_rise: float = 0.02  # a long soak's loss may sit flat within 2 % of where it started
    long_soak_iterations: int = 2000  # after warm-up: from here a flat loss passes
    spike_window: int = 20  # a spike: above the running median of this many iterations before it ...
    spike_z: float = 6.0  # ... by this robust z-score ...
    spike_scale_window: int = 100  # ... the noise: the MAD of the step-to-step changes of this many before it ...
    spike_min_rise: float = 0.05  # ... and at least 5 % above it
    max_loss_spikes: int = 0
    max_grad_norm_ratio: float = 10.0  # after warm-up: a gradient norm over the largest of the spike_window before it
    max_expert_load: float = 4.0  # MoE, after warm-up: median over steps of the busiest expert / the mean
    max_busiest_share: float = 0.9  # MoE: ... and that load over its ceiling E/k (1.0: one expert takes every token)
    max_dropped: float = 0.0  # MoE: routed assignments dropped in a step (stepdeploy renders dropless dispatchers)
    max_router_bias: float = 1.0  # MoE: |expert bias|; sigmoid scores lie in (0, 1)


@dataclass(frozen=True)
class GateVerdict:
    gate: str
    passed: bool
    measured: Any
    threshold: Any
    reason: str


Metrics = Sequence[dict[str, Any]]


def completed(finished_ok: bool, culprits: Sequence[str]) -> GateVerdict:
    if finished_ok:
        return GateVerdict("completed", True, "every rank exited 0", "exit 0 on every rank", "every rank finished")
    first = culprits[0] if culprits else "the run did not finish"
    return GateVerdict("completed", False, list(culprits), "exit 0 on every rank", first)


def losses_finite(metrics: Metrics) -> GateVerdict:
    losses = [m.get("loss") for m in metrics]
    bad = [m["iteration"] for m in metrics if m.get("loss") is None or not math.isfinite(m["loss"])]
    if not losses:
        return GateVerdict("loss_finite", False, None, "finite loss", "no iteration reported a loss")
    if bad:
        return GateVerdict("loss_finite", False, bad[:10], "finite loss", f"non-finite loss at iteration {bad[0]}")
    return GateVerdict("loss_finite", True, losses[-1], "finite loss", f"{len(losses)} finite losses")


def loss_falling(metrics: Metrics, t: Thresholds) -> GateVerdict:
    losses = [m["loss"] for m in metrics if m.get("loss") is not None and math.isfinite(m["loss"])]
    w = t.loss_window
    if len(losses) < 2 * w:
        return GateVerdict("loss_falling", False, len(losses), f">= {2 * w} iterations",
                           f"only {len(losses)} iterations: too few to tell whether the loss falls")
    first, last = statistics.fmean(losses[:w]), statistics.fmean(losses[-w:])
    passed = last < first
    return GateVerdict("loss_falling", passed, {"first": round(first, 4), "last": round(last, 4)}, "last < first",
                       f"loss {first:.4f} -> {last:.4f}" + ("" if passed else ": not falling"))


def steady_step_time(metrics: Metrics) -> tuple[float | None, float | None]:
    """(first step time, median of the steps after the first): the warmup's JIT/compile cost made visible."""
    times = [m["step_time_s"] for m in metrics if m.get("step_time_s") is not None]
    if not times:
        return None, None
    return times[0], statistics.median(times[1:]) if len(times) > 1 else times[0]


def throughput_per_gpu(metrics: Metrics, gpus: int) -> float | None:
    rates = [m["tokens_per_s"] for m in metrics[1:] if m.get("tokens_per_s")]  # the first step is warmup
    return statistics.median(rates) / max(gpus, 1) if rates else None


def scaling_efficiency(current: float | None, previous: float | None, t: Thresholds) -> GateVerdict:
    if previous is None:
        return GateVerdict("scaling_efficiency", True, current, None, "first rung: the baseline")
    if current is None:
        return GateVerdict("scaling_efficiency", False, None, t.min_scaling_efficiency, "no throughput measured")
    ratio = current / previous
    passed = ratio >= t.min_scaling_efficiency
    return GateVerdict("scaling_efficiency", passed, round(ratio, 3), t.min_scaling_efficiency,
                       f"per-GPU throughput {current:,.0f} tok/s = {ratio:.2f} of the previous rung's {previous:,.0f}"
                       + ("" if passed else f" (< {t.min_scaling_efficiency})"))


def mfu_matches_plan(measured: float | None, predicted: float | None, t: Thresholds) -> GateVerdict:
    """A rung that trains another model than the rung before it is not a scaling step (per-GPU throughput of two
    models says nothing about scaling): it is judged by its MFU against the planner's prediction for it."""
    if measured is None or predicted is None:
        return GateVerdict("mfu_vs_plan", True, measured, predicted,
                           "not judged: no MFU measured (CPU run) or no prediction")
    ratio = measured / predicted
    passed = ratio >= t.min_mfu_vs_plan
    return GateVerdict("mfu_vs_plan", passed, round(ratio, 3), t.min_mfu_vs_plan,
                       f"MFU {measured:.1%} = {ratio:.2f} of the plan's {predicted:.1%}"
                       + ("" if passed else f" (< {t.min_mfu_vs_plan})"))


def steady_mfu(metrics: Metrics) -> float | None:
    values = [m["mfu"] for m in metrics[1:] if isinstance(m.get("mfu"), int | float)]  # the first step is warmup
    return statistics.median(values) if values else None


def memory_matches_plan(measured_gib: float | None, predicted_gib: float | None, t: Thresholds) -> GateVerdict:
    if measured_gib is None or predicted_gib is None:
        return GateVerdict("memory_vs_plan", True, measured_gib, predicted_gib,
                           "not judged: no GPU memory measured (CPU run) or no prediction")
    error = (measured_gib - predicted_gib) / predicted_gib
    passed = abs(error) <= t.memory_tolerance
    return GateVerdict("memory_vs_plan", passed, round(measured_gib, 2), round(predicted_gib, 2),
                       f"peak {measured_gib:.2f} GiB vs predicted {predicted_gib:.2f} GiB ({error:+.1%})"
                       + ("" if passed else f", beyond ±{t.memory_tolerance:.0%}"))


def step_time_ceiling(metrics: Metrics, t: Thresholds) -> GateVerdict | None:
    if t.max_step_time_s is None:
        return None
    _first, steady = steady_step_time(metrics)
    passed = steady is not None and steady <= t.max_step_time_s
    return GateVerdict("step_time", passed, steady, t.max_step_time_s,
                       f"steady step {steady if steady is None else round(steady, 3)} s"
                       + ("" if passed else f" exceeds {t.max_step_time_s} s"))
