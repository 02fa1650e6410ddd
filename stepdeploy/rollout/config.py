"""A rollout's configuration (stored as JSON in the ledger) and the error that stops it at a stage.

Kept free of heavy imports: the CLI reads it without loading the SSH and rendering machinery.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any, ClassVar, Literal

from stepdeploy.errors import BadInput, StepdeployError
from stepdeploy.executor_kinds import ExecutorKind
from stepdeploy.remote.executor import Executor
from stepdeploy.rollout import gates
from stepdeploy.rollout.stage_names import STAGES

AUTO = "auto"  # --checkpoint-interval auto: Young/Daly's interval, resolved when the soak starts


class StageFailed(StepdeployError):
    """A gate failed or a stage could not complete; the rollout stops there (and can be resumed)."""


class StageStopped(StageFailed):
    """`rollout stop` asked the stage to stop: it ends `stopped`, not failed (and can be resumed)."""


# How pydantic validates these dataclasses when a configuration is read back (no unknown keys, finite numbers).
PYDANTIC_CONFIG = {"extra": "forbid", "allow_inf_nan": False}


@dataclass(frozen=True)
class RolloutConfig:
    __pydantic_config__: ClassVar[dict[str, Any]] = PYDANTIC_CONFIG
    inventory: str
    model: str
    stages: tuple[str, ...]  # registered stages (rollout/stages/), in rollout order
    layout: str | None = None
    proxy_model: str | None = None
    warmup_iterations: int = 10
    scale_iterations: int = 30
    soak_duration_s: float = 72 * 3600.0
    # soak: end after this many iterations (restarts continue to it), its schedule sized on them rather than on the
    # step time the warm-up measured; the duration then only limits it. None: the soak ends by its duration.
    soak_iterations: int | None = None
    checkpoint_interval: int | Literal["auto"] = 20  # soak: iterations between saves, or AUTO (checkpoint_interval.py)
    keep_checkpoints: int = 2  # the newest K committed checkpoints stay on the nodes (retention)
    mtbf_s: float | None = None  # soak, auto interval: the job's mean time between failures; None: Llama 3's rate
    soak_max_restarts: int = 3
    attempt_timeout_s: float = 1800.0
    pg_timeout_s: int = 60
    poll_interval_s: float | None = None  # None: the executor's own (local, SSH 0.5 s: detection <= 1 s; Slurm 2 s)
    seq_length: int | None = None
    global_batch_size: int | None = None
    executor: ExecutorKind | None = None  # None: remote/registry.py's default_kind
    inject: tuple[str, ...] = ()  # soak fault injections, e.g. "kill:rank=last@10m" (rollout/inject.py)
    monitor_interval_s: float = 5.0  # soak: the monitors' collection period
    heartbeat_timeout_s: float = 180.0  # soak: a running rank without a heartbeat this long is hung
    soak_max_stalled_restarts: int = 2  # soak: stop after this many restarts in a row without progress
    node_wait_s: float = 300.0  # soak: how long a lost node may take to come back before the soak fails
    data: str | None = None  # a dataset `stepdeploy data prepare` wrote (every stage trains on it); None: synthetic
    extra_env: tuple[tuple[str, str], ...] = ()  # --env KEY=VALUE for every rank of every stage (no secrets)
    thresholds: gates.Thresholds = field(default_factory=gates.Thresholds)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "the rollout configuration") -> RolloutConfig:
        """The configuration a ledger holds, checked field by field (types, finite numbers, no unknown keys):
        BadInput naming `source` and the first wrong field otherwise."""
        from pydantic import ValidationError

        try:
            config: RolloutConfig = _validator().validate_python(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "(top level)"
            raise BadInput(f"{source}: {where}: {first['msg']}; not a rollout configuration this stepdeploy "
                           "reads") from None
        unknown = [i for i, name in enumerate(config.stages) if name not in STAGES]
        if unknown:
            raise BadInput(f"{source}: stages.{unknown[0]}: {config.stages[unknown[0]]!r} is not a rollout stage "
                           f"({', '.join(STAGES)}); not a rollout configuration this stepdeploy reads")
        return config

    def checked(self) -> RolloutConfig:
        """This configuration, validated as a ledger's would be (what `rollout run` stores, it can read back)."""
        return RolloutConfig.from_json(self.to_json(), "rollout options")


@cache
def _validator() -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(RolloutConfig)
_DURATION = re.compile(r"(\d{1,9}(?:\.\d{1,9})?)(s|m|h|d)?")  # fullmatch: no trailing newline


def parse_duration(text: str, option: str | None = None) -> float:
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise BadInput(f"{option + ' ' if option else ''}duration {text!r} is not like 90s, 5m, 72h or 3d")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2) or "s"]


def parse_mtbf(text: str | None) -> float | None:
    """`--mtbf DURATION`: the job's mean time between failures (None: not given)."""
    if text is None:
        return None
    seconds = parse_duration(text, "--mtbf")
    if seconds <= 0:
        raise BadInput("--mtbf must be longer than 0 s")
    return seconds


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


def poll_interval(config: RolloutConfig, executor: Executor) -> float:
    """How often the rollout polls the run: the configuration's, else the executor's own (its poll's cost: the local
    executor's is two local processes, an SSH executor's round trips to every node)."""
    if config.poll_interval_s is not None:
        return config.poll_interval_s
    return executor.poll_interval_s
