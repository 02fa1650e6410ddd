"""Values the monitor passes around: one node's sample (what the collector read) and a finding (a judgement).

Samples hold raw readings, counters as totals; judgements compare two samples of the same node and speak
only of what changed between them (FACTS: gates judge deltas, not totals).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Severity(StrEnum):
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Finding:
    """One thing a judgement found. `subject` names where: "gpu 0", "mlx5_0/1", "eth0", "rank 3", "node"."""

    kind: str  # ecc | row_remap | xid | ib_counter | link | netdev | host_memory | disk | hang | loss | ...
    severity: Severity
    subject: str
    message: str
    node: str = ""
    fix: str = ""

    def to_json(self) -> dict:
        return {"kind": self.kind, "severity": self.severity.value, "subject": self.subject,
                "message": self.message, "node": self.node, "fix": self.fix}


@dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str = ""
    bus_id: str = ""  # "00000000:00:06.0" as nvidia-smi prints it
    memory_used_mib: float | None = None
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None


@dataclass(frozen=True)
class XidEvent:
    pci: str  # "0000:3b:00" (domain:bus:device, lower case), as the NVRM line names the GPU
    code: int
    text: str  # the whole kernel log line (identity when the log has no timestamps)
    time_s: float | None = None  # dmesg's seconds since boot


@dataclass(frozen=True)
class IbPort:
    device: str
    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED, ... (the name after "4: ")
    phys_state: str = ""
    counters: dict[str, int] = field(default_factory=dict)
    hw_counters: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"


@dataclass(frozen=True)
class NetDev:
    name: str
    operstate: str  # up | down | unknown | lowerlayerdown ...
    stats: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Disk:
    path: str
    total_bytes: int
    available_bytes: int


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    iteration: int | None
    time: float
    pid: int | None = None


@dataclass(frozen=True)
class RankFile:
    """A rank's status file: running (pid) at start, exited (code, reason) at exit."""

    rank: int
    state: str
    pid: int | None = None
    node: str | None = None
    code: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class MetricsRow:
    iteration: int
    loss: float | None = None
    grad_norm: float | None = None
    step_time_s: float | None = None
    rank_step_time_s: tuple[float, ...] = ()
    tokens_per_s: float | None = None
    time: float | None = None


@dataclass(frozen=True)
class NodeSample:
    """Everything one collector pass read on one node. `errors`: section -> why it could not be read."""

    node: str
    time: float  # the node's clock when the probe ran (heartbeat ages use it: no clock skew)
    gpus: tuple[GpuSample, ...] = ()
    xids: tuple[XidEvent, ...] = ()
    kernel_mark_s: float | None = None  # timestamp of the last kernel log line seen
    ib_ports: tuple[IbPort, ...] = ()
    netdevs: tuple[NetDev, ...] = ()
    meminfo_kib: dict[str, int] = field(default_factory=dict)
    disk: Disk | None = None
    heartbeats: tuple[Heartbeat, ...] = ()
    ranks: tuple[RankFile, ...] = ()
    metrics: tuple[MetricsRow, ...] = ()
    rank_proc_states: dict[int, str] = field(default_factory=dict)  # rank -> process state (R, S, D, T...)
    errors: dict[str, str] = field(default_factory=dict)

    def gpu(self, index: int) -> GpuSample | None:
        return next((g for g in self.gpus if g.index == index), None)


@dataclass(frozen=True)
class MonitorLimits:
    """The limits the monitors judge a node's samples by, live (docs/monitoring.md explains each default); not the
    rollout's gates, which judge an attempt when it ends (rollout/gates.py Thresholds)."""

    heartbeat_timeout_s: float = 180.0  # nvidia-resiliency-ext's Megatron example: step section timeout
    loss_spike_factor: float = 3.0  # a loss above k x the running median of the previous losses
    loss_window: int = 50  # how many previous losses make the running median
    loss_min_history: int = 10  # no spike verdict before this many previous losses
    grad_norm_max: float = 100.0  # above: warn (clipping hides it from the loss, not from us)
    straggler_fraction: float = 0.2  # a rank's mean step time above (1 + f) x the ranks' median: warn
    straggler_min_steps: int = 3  # new metrics rows needed before judging skew
    netdev_drops_per_interval: int = 100  # rx/tx drops are noisy on busy hosts: warn only above this
    host_memory_min_available: float = 0.05  # MemAvailable / MemTotal below: warn
    disk_min_free: float = 0.10  # available / total below: warn; below a fifth of it: fail
