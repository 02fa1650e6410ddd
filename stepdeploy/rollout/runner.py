"""The rollout controller: the ledger's stages in order, each run by its registered stage (rollout/stages/) over
one attempt service (rollout/service.py); every transition written to the ledger before it is acted on, so
`rollout resume` continues after any crash of the controller (kill -9 included).

Every attempt ends in a final state: passed, failed (a gate, a failed run, or any error on the way: a launch
refused by a node, an unreachable node, a full disk), or stopped (`rollout stop`). A stop ends the stage and
the run `stopped` (StageStopped), never `failed`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from stepdeploy.errors import BadInput
from stepdeploy.inventory import load_cluster
from stepdeploy.inventory.model import Cluster
from stepdeploy.ledger import Ledger, NotALedger
from stepdeploy.rollout import stages
from stepdeploy.rollout.attempt import Live
from stepdeploy.rollout.clock import REAL, Clock
from stepdeploy.rollout.config import RolloutConfig, StageFailed, StageStopped
from stepdeploy.rollout.inject import FaultActions
from stepdeploy.rollout.service import AttemptService, Executors


class Rollout:
    def __init__(self, run_dir: Path, ledger: Ledger, run_id: str, config: RolloutConfig,
                 on_tick: Callable[[Live], None] = lambda _live: None, cluster: Cluster | None = None, *,
                 clock: Clock = REAL, executors: Executors | None = None, faults: FaultActions | None = None) -> None:
        """`cluster`: the inventory as the CLI accepted it (host-key checking); None: read config.inventory.
        The rest goes to the attempt service (rollout/service.py): `on_tick` sees every poll of the live view."""
        self.ledger, self.run_id = ledger, run_id
        self.service = AttemptService(run_dir, ledger, run_id, config, cluster or load_cluster(config.inventory),
                                      on_tick=on_tick, clock=clock, executors=executors, faults=faults)

    def run(self) -> None:
        unknown = [s.name for s in self.ledger.stages(self.run_id) if s.name not in stages.STAGES]
        if unknown:  # before anything is written
            raise NotALedger(f"{self.ledger.path}: stage {unknown[0]!r} is not a rollout stage "
                             f"({', '.join(stages.STAGES)}); not a ledger this stepdeploy wrote")
        self.ledger.set_run_status(self.run_id, "running")
        while (stage := self.ledger.next_stage(self.run_id)) is not None:
            if self.service.stop_requested():
                self.ledger.set_stage(self.run_id, stage.name, "stopped", "stop requested")
                self.ledger.set_run_status(self.run_id, "stopped")
                return
            self.ledger.set_stage(self.run_id, stage.name, "running")
            try:
                try:
                    stages.load(stage.name).run(self.service)
                except BadInput as exc:  # met once the rollout runs (a rendering refused): the stage fails
                    raise StageFailed(f"{stage.name}: {exc.message}", hint=exc.hint) from None
            except StageStopped as exc:
                self.ledger.set_stage(self.run_id, stage.name, "stopped", exc.message)
                self.ledger.set_run_status(self.run_id, "stopped")
                raise
            except StageFailed as exc:
                self.ledger.set_stage(self.run_id, stage.name, "failed", exc.message)
                self.ledger.set_run_status(self.run_id, "failed")
                raise
            self.ledger.set_stage(self.run_id, stage.name, "passed")
        self.ledger.set_run_status(self.run_id, "passed")
