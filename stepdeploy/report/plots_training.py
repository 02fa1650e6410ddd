"""Plots of the per-step training metrics the workload records when it has them (learning rate, gradient norm,
MoE expert load, megatron's load-balancing loss, router bias, MTP losses) and of the soak's goodput. Conventions
and helpers: plots.py."""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes

from stepdeploy.report.plot_base import (
    Drawer,
    TimeAxis,
    by_segment,
    draw_attempts,
    legend,
    per_attempt,
    plain,
    shade_stages,
)
from stepdeploy.report.summary import (
    FAILURE_LABELS,
    GOODPUT_LABELS,
    MTP_LOSS,
    STARTUP_LABELS,
    RunData,
    last_event_data,
)

MAX_LAYER_LINES = 64  # per-layer expert load: one thin line each, up to this many layers
PART_COLORS = {"productive": "#2ca02c", "startup": "#1f77b4", "checkpoint": "#9467bd", "failures": "#d62728",
               "redone": "#ff7f0e", "other": "#c7c7c7"}
STARTUP_COLORS = dict(zip(STARTUP_LABELS, ("#08306b", "#2171b5", "#4292c6", "#6baed6", "#9ecae1", "#c6dbef"),
                          strict=True))
FAILURE_COLORS = dict(zip(FAILURE_LABELS, ("#67000d", "#cb181d", "#fb6a4a"), strict=True))
MIN_LABELLED = 0.06  # share of the widest bar a segment needs to carry its figure


def _lr(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    return by_segment(data, ax, axis, "lr", "learning rate")


def _grad_norm(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    return by_segment(data, ax, axis, "grad_norm", "gradient norm")


def _router_bias(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    return by_segment(data, ax, axis, "router_bias_absmax", "largest |router bias|")


def _per_name(data: RunData, prefix: str) -> dict[str, list[dict[str, Any]]]:
    """Rows of the metrics named `prefix/<k>` (per layer, per MTP depth), by name, in numeric order of k."""
    found = {name: [r for r in rows if r["attempt_id"] in data.segment_of] for name, rows in data.metrics.items()
             if name.startswith(prefix + "/")}
    return dict(sorted(((n, r) for n, r in found.items() if r), key=lambda item: _order(item[0])))


def _order(name: str) -> tuple[int, str]:
    tail = name.rsplit("/", 1)[-1]
    return (int(tail), "") if tail.isdigit() else (1 << 30, tail)


def _lines(ax: Axes, axis: TimeAxis, rows: list[dict[str, Any]], label: str | None, **style: Any) -> None:
    """One series, a line per attempt (a restart leaves a gap), labelled once."""
    draw_attempts(ax, axis, per_attempt(rows).values(), label, **style)


def _each_layer(data: RunData, ax: Axes, axis: TimeAxis, prefix: str) -> None:
    """The per-layer series `prefix/<layer>` thin and grey (up to MAX_LAYER_LINES layers), under a summary line."""
    layers = _per_name(data, prefix)
    if len(layers) <= MAX_LAYER_LINES:
        for i, rows in enumerate(layers.values()):
            _lines(ax, axis, rows, "each MoE layer" if i == 0 else None, color="#bbbbbb", linewidth=0.7)


def _moe_load(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    """The most loaded expert over the mean, per step: every MoE layer thin and grey, the worst layer by rung."""
    _each_layer(data, ax, axis, "moe_load")
    drawn = by_segment(data, ax, axis, "moe_load_max", "expert load (max / mean)")
    if drawn:
        ax.axhline(1.0, color="#888888", linewidth=0.8, linestyle=":")  # perfectly balanced
    return drawn


def _aux_loss(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    """megatron's load-balancing loss before its coefficient: every MoE layer thin and grey, the mean by rung."""
    _each_layer(data, ax, axis, "moe_aux_loss")
    return by_segment(data, ax, axis, "moe_aux_loss_mean", "load-balancing loss (mean over layers)")


def _mtp_loss(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    depths = _per_name(data, MTP_LOSS)
    if not depths:
        return False
    shade_stages(data, ax, axis)
    for k, (name, rows) in enumerate(depths.items()):
        _lines(ax, axis, rows, plain(f"MTP depth {name.rsplit('/', 1)[-1]}"), color=f"C{k % 10}", linewidth=1.2)
    ax.set_ylabel("MTP loss")
    legend(ax)
    return True


def _goodput(data: RunData, ax: Axes, axis: TimeAxis) -> bool:
    """The soak's wall time by part (a stacked bar), and under it start-up and failures by part."""
    goodput = last_event_data(data.events, "goodput")
    if not goodput or not goodput.get("wall_s"):
        return False
    wall = float(goodput["wall_s"])
    scale, unit = (1.0, "s") if wall <= 300 else (60.0, "min") if wall <= 3 * 3600 else (3600.0, "h")
    bars = [("soak wall", goodput.get("parts", {}), GOODPUT_LABELS, PART_COLORS),
            ("start-up", goodput.get("startup_parts", {}), STARTUP_LABELS, STARTUP_COLORS),
            ("failures", goodput.get("failure_parts", {}), FAILURE_LABELS, FAILURE_COLORS)]
    bars = [bar for i, bar in enumerate(bars) if i == 0 or sum(bar[1].values()) > 0]
    for i, (_name, values, labels, colors) in enumerate(bars):
        y, left = len(bars) - 1 - i, 0.0  # the wall on top, drawn (and so listed in the legend) first
        for key, label in labels.items():
            seconds = float(values.get(key) or 0.0)
            if seconds <= 0:
                continue
            ax.barh(y, seconds / scale, left=left, color=colors[key], edgecolor="white", label=label)
            if seconds / wall >= MIN_LABELLED:
                ax.text(left + seconds / scale / 2, y, f"{seconds / wall:.0%}", ha="center", va="center", fontsize=7,
                        color="white" if key in ("productive", "failures", "launch", "imports_init") else "black")
            left += seconds / scale
    ax.set_yticks(range(len(bars)), [bar[0] for bar in bars][::-1])
    ax.set_xlabel(f"time ({unit}); ratio {goodput['ratio']:.1%} productive" if goodput.get("ratio") is not None
                  else f"time ({unit})")
    legend(ax, ncols=2)
    return True


TRAINING_PLOTS: list[tuple[str, str, str, Drawer]] = [
    ("lr", "Learning rate", "the learning rate of every step, coloured by stage/rung (warm-up, then the decay)", _lr),
    ("grad_norm", "Gradient norm", "the global gradient norm before clipping, coloured by stage/rung", _grad_norm),
    ("moe_load", "Expert load", "tokens of the most loaded expert over the mean, per step (1 = balanced): the worst "
     "MoE layer by stage/rung, every layer in grey", _moe_load),
    ("moe_aux_loss", "Load-balancing loss", "megatron's auxiliary load-balancing loss of each MoE layer before its "
     "coefficient (about 1 when balanced): the mean over the layers by stage/rung, every layer in grey", _aux_loss),
    ("router_bias", "Router bias", "the largest absolute expert bias of the sigmoid router (expert-bias balancing)",
     _router_bias),
    ("mtp_loss", "MTP losses", "the multi-token-prediction loss of every MTP depth", _mtp_loss),
]
GOODPUT_PLOT: tuple[str, str, str, Drawer] = (
    "goodput", "Goodput", "where the soak's wall time went (share of the wall on each part); below, its start-up "
    "and failures by part", _goodput)
UNTIMED = ("goodput",)  # its x axis is a duration, not the run's clock
