"""A rollout's configuration (stored as JSON in the ledger) and the error that stops it at a stage.

Kept free of heavy imports: the CLI reads it without loading the SSH and rendering machinery.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from stepdeploy.errors import BadInput, StepdeployError
from stepdeploy.rollout import gates

AUTO = "auto"  # --checkpoint-interval auto: Young/Daly's interval, resolved when the soak starts


class StageFailed(StepdeployError):
    """A gate failed or a stage could not complete; the rollout stops there (and can be resumed)."""


@dataclass(frozen=True)
class RolloutConfig:
    inventory: str
    model: str
    stages: tuple[str, ...]
    layout: str | None = None
    proxy_model: str | None = None
    warmup_iterations: int = 10
    scale_iterations: int = 30
    soak_duration_s: float = 72 * 3600.0
    checkpoint_interval: int | str = 20  # soak: iterations between saves, or AUTO (rollout/checkpoint_interval.py)
    mtbf_s: float | None = None  # soak, auto interval: the job's mean time between failures; None: Llama 3's rate
    soak_max_restarts: int = 3
    attempt_timeout_s: float = 1800.0
    pg_timeout_s: int = 60
    poll_interval_s: float = 2.0
    seq_length: int | None = None
    global_batch_size: int | None = None
    executor: str | None = None  # fabric | slurm; None: the inventory's `stepdeploy_executor`, else fabric
    inject: tuple[str, ...] = ()  # soak fault injections, e.g. "kill:rank=last@10m" (rollout/inject.py)
    monitor_interval_s: float = 5.0  # soak: the monitors' collection period
    heartbeat_timeout_s: float = 180.0  # soak: a running rank without a heartbeat this long is hung
    soak_max_stalled_restarts: int = 2  # soak: stop after this many restarts in a row without progress
    node_wait_s: float = 300.0  # soak: how long a lost node may take to come back before the soak fails
    data: str | None = None  # a dataset `stepdeploy data prepare` wrote (every stage trains on it); None: synthetic
    thresholds: gates.Thresholds = field(default_factory=gates.Thresholds)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutConfig:
        data = dict(data)
        data["stages"] = tuple(data["stages"])
        data["inject"] = tuple(data.get("inject", ()))
        data["thresholds"] = gates.Thresholds(**data.get("thresholds", {}))
        return cls(**data)


def parse_checkpoint_interval(text: str) -> int | str:
    """`--checkpoint-interval`: a number of iterations (at least 1) or `auto`."""
    value = text.strip().lower()
    if value == AUTO:
        return AUTO
    try:
        iterations = int(value)
    except ValueError:
        raise BadInput(f"--checkpoint-interval {text!r} is neither a number of iterations nor auto",
                       hint="--checkpoint-interval 20, or --checkpoint-interval auto [--mtbf 6h]") from None
    if iterations < 1:
        raise BadInput(f"--checkpoint-interval {iterations} must be at least 1 (or auto)")
    return iterations
