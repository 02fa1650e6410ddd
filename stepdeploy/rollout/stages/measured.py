"""What the warm-up stage measured of the target, as the soak sizes its schedule and checkpoint interval by it.

The warm-up records it (`record`) as one `warmup` event of its stage; a later stage, in this controller or in one
that resumed the rollout, reads it back typed (`TargetStep.measured`): the event's keys are written and read here
only. What the warm-up did not measure is None, and `step` says where the figure it falls back on came from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdeploy.inventory.model import Cluster
from stepdeploy.rollout.attempt import read_phases
from stepdeploy.rollout.checkpoint_interval import planned_step
from stepdeploy.rollout.config import RolloutConfig
from stepdeploy.rollout.service import AttemptService

STAGE, KIND = "warmup", "warmup"  # the stage that measures, and the kind of its event


@dataclass(frozen=True)
class TargetStep:
    """The target model's step on every node, as the warm-up measured it."""

    first_step_s: float | None = None  # its first step (compilation and start-up costs included)
    steady_step_s: float | None = None  # the median of the steps after the first
    startup_s: float = 0.0  # from its attempt's start to the end of its first step (0: not measured)
    predicted_step_s: float | None = None  # the planner's prediction for the layout it ran

    def record(self, service: AttemptService) -> None:
        """One `warmup` event of the warm-up stage: its step times (what the report shows)."""
        service.event(STAGE, KIND, f"first step {self.first_step_s} s, steady step {self.steady_step_s} s",
                      {"first_step_s": self.first_step_s, "steady_step_s": self.steady_step_s})

    @classmethod
    def measured(cls, service: AttemptService) -> TargetStep:
        """What the warm-up of this rollout measured (every field None or 0 when it did not run)."""
        steady = first = None
        for event in service.events(STAGE, kind=KIND):
            if event["data"].get("steady_step_s"):
                first, steady = event["data"].get("first_step_s"), float(event["data"]["steady_step_s"])
                break
        attempts = service.attempts(STAGE)
        predicted = next((float(p) for a in attempts if (p := (a["detail"].get("plan") or {}).get("predicted_step_s"))),
                         None)
        return cls(first, steady, _startup(attempts), predicted)

    def step(self, cluster: Cluster, config: RolloutConfig) -> tuple[float, str]:
        """The target's step time and where it came from: the warm-up's steady step, else the planner's prediction
        (the warm-up's, else one made now)."""
        if self.steady_step_s:
            return self.steady_step_s, "measured in the warm-up"
        if self.predicted_step_s:
            return self.predicted_step_s, "the planner's prediction"
        return planned_step(cluster, config)


def _startup(attempts: list[dict[str, Any]]) -> float:
    """Seconds from the warm-up's start to the end of its first step (its `first_step` phase): what a soak spends
    before it trains. 0 when the warm-up did not measure it (it did not run, or its phases were not fetched)."""
    for attempt in attempts:
        run = attempt["detail"].get("local_run")
        if not isinstance(run, str) or not isinstance(attempt.get("started"), int | float):
            continue
        first = next((p for p in read_phases(Path(run) / "fetched") if p.get("phase") == "first_step"
                      and isinstance(p.get("time"), int | float)), None)
        if first is not None:
            return max(0.0, float(first["time"]) - float(attempt["started"]))
    return 0.0
