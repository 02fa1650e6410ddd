"""The soak's training gates: is the run training, and is it healthy? Pure judgements over the soak's metrics
(every line of the run's metrics file, across restarts; an iteration redone after a restart counts once, as its
last run), like rollout/gates.py's.

    loss_trend      the loss falls over the soak after its warm-up (mean of the last window below the first);
                    on a long soak (>= long_soak_iterations after warm-up) a flat loss within max_loss_rise
                    also passes. A soak whose learning rate is ~0 sits flat and fails.
    loss_spikes     iterations whose loss stands out of the running median of the spike_window before it:
                    by more than spike_z x the run's noise (the MAD of the step-to-step changes of up to
                    spike_scale_window iterations before it, over sqrt 2) and at least spike_min_rise above it.
    grad_norm       every step's gradient norm is finite; after warm-up none jumps above max_grad_norm_ratio x
                    the largest of the spike_window norms before it (the seed's "gradient value range").
    expert_load     MoE models, after warm-up: the median over steps of the busiest expert's tokens over the
                    mean (the worst layer each step) within max_expert_load and within max_busiest_share of its
                    ceiling E/k (where one expert takes every token); no token dropped beyond
                    max_dropped; the router's expert bias within max_router_bias (sigmoid scores lie in (0, 1):
                    a bias beyond 1 outweighs any score, the router no longer decides).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any

from stepdeploy.rollout.gates import GateVerdict, Thresholds

Metrics = Sequence[dict[str, Any]]


GATES = ("loss_trend", "loss_spikes", "grad_norm")
MOE_GATES = ("expert_load", "tokens_dropped")  # and router_bias with expert-bias balancing


def gate_names(moe: bool, expert_bias: bool) -> list[str]:
    """The training gates a soak of such a model gets (what `rollout run --dry-run` lists)."""
    return [*GATES, *(MOE_GATES if moe else ()), *(("router_bias",) if moe and expert_bias else ())]


def kept(metrics: Metrics) -> list[dict[str, Any]]:
    """One line per iteration (the last run of an iteration redone after a restart), in iteration order."""
    last: dict[int, dict[str, Any]] = {}
    for m in metrics:
        if isinstance(m.get("iteration"), int):
            last[m["iteration"]] = m
    return [last[i] for i in sorted(last)]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def loss_trend(metrics: Metrics, warmup: int, t: Thresholds) -> GateVerdict:
    losses = [m["loss"] for m in kept(metrics) if m["iteration"] > warmup and _finite(m.get("loss"))]
    w = max(t.loss_window, int(len(losses) * t.trend_window_fraction))
    if len(losses) < 2 * w:
        return GateVerdict("loss_trend", False, len(losses), f">= {2 * w} iterations after warm-up",
                           f"only {len(losses)} iteration(s) after the warm-up of {warmup}: too few to judge "
                           "the loss's trend (a longer soak, or a shorter step)")
    first, last = statistics.fmean(losses[:w]), statistics.fmean(losses[-w:])
    measured = {"first": round(first, 4), "last": round(last, 4), "window": w, "iterations": len(losses)}
    if last < first:
        return GateVerdict("loss_trend", True, measured, "falling", f"loss {first:.4f} -> {last:.4f} over "
                           f"{len(losses)} iterations after warm-up (means of {w})")
    rise = (last - first) / abs(first) if first else math.inf
    long = len(losses) >= t.long_soak_iterations
    if long and rise <= t.max_loss_rise:
        return GateVerdict("loss_trend", True, measured, f"flat within {t.max_loss_rise:.0%} (long soak)",
                           f"loss flat {first:.4f} -> {last:.4f} ({rise:+.1%}) over {len(losses)} iterations")
    why = (f"rose {rise:+.1%}, beyond {t.max_loss_rise:.0%}" if long else
           f"not falling ({rise:+.1%}) in a soak of {len(losses)} iterations after warm-up (a flat loss passes "
           f"only from {t.long_soak_iterations}): is the learning rate ~0, or the data repeating?")
    return GateVerdict("loss_trend", False, measured, "falling", f"loss {first:.4f} -> {last:.4f}: {why}")


def loss_spikes(metrics: Metrics, warmup: int, t: Thresholds) -> GateVerdict:
    # The level is the running median of the spike_window losses before an iteration; the noise it is judged
    # against comes from the step-to-step changes of up to spike_scale_window iterations before it (their MAD over
    # sqrt 2: a trend shifts every change alike and drops out). A MAD of the spike_window losses alone is a noisy
    # estimate: eight of twenty losses of the simulated cluster's tiny model (256 tokens a step, noise ~0.17) fell
    # within 0.07 of each other, and an ordinary 2-sigma step read as z = 6 (iteration 284, 6.530 vs 6.173). In
    # the H200's 300 s MoE proxy soak it finds more planted spikes than that did: x1.2 at 162 of 215 places, not 124.
    rows = [m for m in kept(metrics) if _finite(m.get("loss"))]
    losses = [m["loss"] for m in rows]
    diffs = [b - a for a, b in itertools.pairwise(losses)]  # diffs[k]: the change from row k to row k + 1
    spikes: list[dict[str, float]] = []
    for i, m in enumerate(rows):
        if m["iteration"] <= warmup:
            continue
        changes = diffs[max(0, i - 1 - t.spike_scale_window):max(0, i - 1)]
        if len(changes) < t.spike_window:  # so spike_window losses before it, too
            continue
        median = statistics.median(losses[i - t.spike_window:i])
        centre = statistics.median(changes)
        noise = statistics.median(abs(c - centre) for c in changes) * 1.4826 / math.sqrt(2)
        z = (m["loss"] - median) / noise if noise > 0 else (math.inf if m["loss"] > median else 0.0)
        if z > t.spike_z and m["loss"] > median * (1 + t.spike_min_rise):
            spikes.append({"iteration": m["iteration"], "loss": m["loss"], "median": round(median, 4)})
    passed = len(spikes) <= t.max_loss_spikes
    where = ", ".join(f"{s['iteration']} ({s['loss']:.3f} vs {s['median']:.3f})" for s in spikes[:5])
    return GateVerdict("loss_spikes", passed, {"count": len(spikes), "spikes": spikes[:10]}, t.max_loss_spikes,
                       f"{len(spikes)} loss spike(s) above the running median of {t.spike_window}"
                       + (f": at {where}" if spikes else ""))


def grad_norm_range(metrics: Metrics, warmup: int, t: Thresholds) -> GateVerdict:
    rows = [m for m in kept(metrics) if m.get("grad_norm") is not None]
    bad = [m["iteration"] for m in rows if not _finite(m["grad_norm"])]
    if bad:
        return GateVerdict("grad_norm", False, {"non_finite_at": bad[:10]}, "finite",
                           f"non-finite gradient norm at iteration {bad[0]}")
    after = [m["grad_norm"] for m in rows if m["iteration"] > warmup]
    if not after:
        return GateVerdict("grad_norm", False, len(rows), "gradient norms after warm-up",
                           "no gradient norm reported after the warm-up")
    # A jump: above max_grad_norm_ratio x the largest of the spike_window norms before it -- sudden, not a ramp.
    # From a fresh start the norms move tenfold and more in either direction over the first tens of steps, and
    # that is training, not a fault: on the H200 the Step-3.5-Flash slice's fell from 149 to 1.3, the dense
    # proxy's rose from 0.3 to 10 by step 40 and fell to 0.7 by step 170. A whole-soak median (calls N/O) failed
    # the first, a running median or a last-over-first window the second. A run diverging shows in the loss gates.
    spikes: list[dict[str, float]] = []
    for i, m in enumerate(rows):
        before = [r["grad_norm"] for r in rows[max(0, i - t.spike_window):i]]
        if m["iteration"] <= warmup or len(before) < t.spike_window:
            continue
        top = max(before)
        if m["grad_norm"] > t.max_grad_norm_ratio * top:
            spikes.append({"iteration": m["iteration"], "grad_norm": m["grad_norm"], "before_max": round(top, 5)})
    measured = {"min": round(min(after), 5), "median": round(statistics.median(after), 5),
                "max": round(max(after), 5), "spikes": spikes[:10]}
    passed = not spikes
    reason = f"gradient norm {min(after):.3g}..{max(after):.3g} after warm-up"
    if spikes:
        s = spikes[0]
        reason += (f"; {len(spikes)} jump(s) above {t.max_grad_norm_ratio}x the largest of the {t.spike_window} "
                   f"before: first at iteration {s['iteration']} ({s['grad_norm']:.3g} vs {s['before_max']:.3g})")
    else:
        reason += f", no jump above {t.max_grad_norm_ratio}x the largest of the {t.spike_window} before"
    return GateVerdict("grad_norm", passed, measured, t.max_grad_norm_ratio, reason)


def expert_load(metrics: Metrics, warmup: int, t: Thresholds) -> list[GateVerdict]:
    """[] for a dense model (no line carries an expert load)."""
    rows = [m for m in kept(metrics) if m["iteration"] > warmup]
    loads = [m["moe_load_max"] for m in rows if _finite(m.get("moe_load_max"))]
    if not any(_finite(m.get("moe_load_max")) for m in kept(metrics)):
        return []
    if not loads:
        return [GateVerdict("expert_load", False, None, t.max_expert_load,
                            "no expert load reported after the warm-up")]
    median = statistics.median(loads)
    # At the ceiling E/k (experts over the experts each token goes to) the busiest expert takes every token: with
    # few experts (the 1-GPU slice: 32 of which 8, a ceiling of 4) max_expert_load alone could never fail.
    ceiling = next((m["moe_load_ceiling"] for m in rows if _finite(m.get("moe_load_ceiling"))), None)
    share = median / ceiling if ceiling else None
    passed = median <= t.max_expert_load and (share is None or share <= t.max_busiest_share)
    measured = {"median": round(median, 3), "max": round(max(loads), 3), "steps": len(loads)}
    if share is not None:
        measured |= {"ceiling": ceiling, "share": round(share, 3)}
    why = ""
    if median > t.max_expert_load:
        why = f", beyond {t.max_expert_load}"
    elif share is not None and share > t.max_busiest_share:
        why = (f": {share:.0%} of its ceiling {ceiling:g} (> {t.max_busiest_share:.0%}), the busiest expert takes "
               "(nearly) every token: the router has collapsed onto it")
    layers = layer_medians(rows)
    if layers:  # which layers the worst-layer figure comes from, against the limit the median is held to
        limit = t.max_expert_load if share is None else min(t.max_expert_load, t.max_busiest_share * ceiling)
        over = sorted(((v, layer) for layer, v in layers.items() if v > limit), reverse=True)
        measured |= {"layers": len(layers), "layers_over": len(over)}
        why += "; " + _layers_over(over, len(layers), limit)
    verdicts = [GateVerdict("expert_load", passed, measured, t.max_expert_load,
                            f"busiest expert {median:.2f}x the mean (median over {len(loads)} steps after warm-up, "
                            f"worst layer each step; 1.0 is perfect balance)" + why)]
    dropped = max((m["moe_dropped"] for m in rows if _finite(m.get("moe_dropped"))), default=0.0)
    verdicts.append(GateVerdict("tokens_dropped", dropped <= t.max_dropped, dropped, t.max_dropped,
                                f"at most {dropped:.2%} of the routed assignments dropped in a step"))
    biases = [m["router_bias_absmax"] for m in rows if _finite(m.get("router_bias_absmax"))]
    if biases:
        top = max(biases)
        verdicts.append(GateVerdict("router_bias", top <= t.max_router_bias, round(top, 5), t.max_router_bias,
                                    f"largest |expert bias| {top:.4f} (drift from 0 after "
                                    f"{rows[-1]['iteration']} iterations)"
                                    + ("" if top <= t.max_router_bias else ": it outweighs the router's scores")))
    return verdicts


def _layers_over(over: list[tuple[float, str]], layers: int, limit: float) -> str:
    """The layers whose own median is over the limit, worst first (four named), or that none is."""
    if not over:
        return f"no layer's own median above {limit:g} (of {layers})"
    named = ", ".join(f"layer {layer} {v:.2f}" for v, layer in over[:4]) + (", ..." if len(over) > 4 else "")
    return f"by its own median {len(over)} of {layers} layer(s) above {limit:g}: {named}"


def layer_medians(rows: Metrics) -> dict[str, float]:
    """Each MoE layer's own median over the steps of its busiest expert over the mean (the lines' `moe_load`),
    {} where no line has them: which layers the worst-layer figure comes from."""
    per_layer: dict[str, list[float]] = {}
    for m in rows:
        for layer, value in (m.get("moe_load") or {}).items():
            if _finite(value):
                per_layer.setdefault(str(layer), []).append(value)
    return {layer: round(statistics.median(values), 3) for layer, values in per_layer.items()}


def soak_training_gates(metrics: Metrics, warmup: int, t: Thresholds) -> list[GateVerdict]:
    return [loss_trend(metrics, warmup, t), loss_spikes(metrics, warmup, t), grad_norm_range(metrics, warmup, t),
            *expert_load(metrics, warmup, t)]
