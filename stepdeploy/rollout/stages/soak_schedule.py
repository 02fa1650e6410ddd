"""The soak's learning-rate schedule: warm-up and cosine decay sized from the soak's expected iterations (the
soak, rollout/stages/soak.py, renders its run with it; `rollout run --dry-run` shows it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SoakSchedule:
    """The soak's learning-rate schedule, sized from its expected iterations."""

    step_s: float
    source: str
    expected: int
    warmup: int
    decay: int
    startup_s: float = 0.0  # taken off the soak's duration before it is divided into steps

    def to_json(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "source": self.source, "expected_iterations": self.expected,
                "warmup_iterations": self.warmup, "decay_iterations": self.decay, "startup_s": round(self.startup_s, 2)}


MAX_WARMUP = 2000  # iterations: megatron's usual warm-up for long pre-training runs
FIXED_SOURCE = "fixed by --soak-iterations"


def soak_schedule(duration_s: float, step_s: float, source: str, startup_s: float = 0.0,
                  iterations: int | None = None) -> SoakSchedule:
    """Warm-up 5 % of the expected iterations (1 to MAX_WARMUP), then the cosine decay over the rest: the soak trains
    as a run of its length would. The expected iterations are `iterations` (--soak-iterations: the same on any
    machine), else what the duration less the start-up (as the warm-up measured it; at most half the duration: the
    warm-up's start can be a cold one) holds: a 20-minute soak of the dense proxy expected 1,956 iterations without
    it and counted 1,699 (its two starts took 35 s, the rest went to redone iterations and to saves)."""
    if iterations is not None:
        warmup = min(MAX_WARMUP, max(1, iterations // 20))
        return SoakSchedule(step_s, FIXED_SOURCE, iterations, warmup, max(iterations, warmup + 1))
    startup = min(max(0.0, startup_s), duration_s / 2)
    expected = max(2, int((duration_s - startup) / max(step_s, 1e-3)))
    warmup = min(MAX_WARMUP, max(1, expected // 20))
    return SoakSchedule(step_s, source, expected, warmup, max(expected, warmup + 1), startup)


__all__ = ["FIXED_SOURCE", "MAX_WARMUP", "SoakSchedule", "soak_schedule"]
