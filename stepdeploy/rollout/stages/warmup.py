"""The warm-up stage: the target model on every slot of every node for a few iterations, to see it start, train
and finish (its first and steady step times are recorded, stages/measured.py: the soak sizes its schedule from
them)."""

from __future__ import annotations

from typing import Any

from stepdeploy.inventory.model import Cluster
from stepdeploy.rollout import gates
from stepdeploy.rollout.config import RolloutConfig
from stepdeploy.rollout.ladder import target_rung
from stepdeploy.rollout.service import AttemptService
from stepdeploy.rollout.stages.gated import GATES, gated_attempt
from stepdeploy.rollout.stages.measured import TargetStep


class Warmup:
    name = "warmup"

    def gates(self) -> list[str]:
        return list(GATES)

    def run(self, service: AttemptService) -> None:
        rung = target_rung(service.cluster, service.config.model)
        metrics = gated_attempt(service, self.name, rung, service.config.warmup_iterations, self.gates())
        first, steady = gates.steady_step_time(metrics)
        TargetStep(first_step_s=first, steady_step_s=steady).record(service)  # the soak sizes itself by it

    def plan(self, config: RolloutConfig, cluster: Cluster) -> dict[str, Any]:
        return {**target_rung(cluster, config.model).as_dict(), "iterations": config.warmup_iterations,
                "gates": self.gates()}


STAGE = Warmup()
