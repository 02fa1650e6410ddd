"""The learning-rate schedule both engines follow (standard library only; shipped as a file): a linear warm-up to
the peak over `warmup_iterations`, then a cosine decay to `min_lr_ratio` x the peak at `decay_iterations`, then
constant -- megatron's `--lr-decay-style cosine` with `--min-lr` at a tenth of the peak by default.

A function of the iteration alone, so a run resumed from a checkpoint continues the schedule where the
interrupted one was. The rollout sizes a soak's schedule from its expected iterations (duration / measured step
time), so that a soak learns instead of crawling through a warm-up sized for a billion iterations.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_MIN_LR_RATIO = 0.1


def lr_at(iteration: int, training: dict[str, Any]) -> float:
    """The learning rate of `iteration` (1-based) under workload.json's `training` section."""
    peak, warmup = training["lr"], max(1, int(training["warmup_iterations"]))
    decay = int(training.get("decay_iterations") or training["iterations"])
    floor = peak * training.get("min_lr_ratio", DEFAULT_MIN_LR_RATIO)
    if iteration <= warmup:
        return peak * iteration / warmup
    progress = min(1.0, (iteration - warmup) / max(1, decay - warmup))
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
