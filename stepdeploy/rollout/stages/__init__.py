"""The rollout's stages, registered by name in the order a rollout runs them.

Each stage is a module under rollout/stages/ with one object, STAGE, that implements `Stage`:

    name                   how --stages and the ledger call it
    run(service)           run the stage through the attempt service (rollout/service.py): render, launch,
                           follow, collect, record; raise StageFailed (StageStopped on a stop request) to end it
    plan(config, cluster)  what `run` will do, as JSON for `rollout run --dry-run`: its rungs, iterations or
                           duration, and the exact names of the gates it will judge (the names `run` records:
                           the service refuses a verdict whose gate the plan does not list)

Modules are imported only when their stage is used. A fourth stage is one such module and one line in
rollout/stage_names.py (the names, below the configuration, which checks them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from stepdeploy.rollout.stage_names import REGISTRY, STAGES, parse_stages

if TYPE_CHECKING:
    from stepdeploy.inventory.model import Cluster
    from stepdeploy.rollout.config import RolloutConfig
    from stepdeploy.rollout.service import AttemptService


class Stage(Protocol):
    name: str

    def run(self, service: AttemptService) -> None: ...

    def plan(self, config: RolloutConfig, cluster: Cluster) -> Any: ...


def load(name: str) -> Stage:
    """The registered stage `name` (KeyError: not a stage)."""
    stage: Stage = importlib.import_module(REGISTRY[name]).STAGE
    return stage


__all__ = ["REGISTRY", "STAGES", "Stage", "load", "parse_stages"]
