"""The executor protocol: what the controller can do to a rendered run on its nodes, and the values it gets
back. Every call answers per node (a node that cannot be reached is one entry, never an exception that
hides the others). Implementations, registered by name in registry.py: fabric (SSH to every node), slurm (one
sbatch job) and local (this machine, no SSH); a fourth is one module with a `create` constructor there.

Events an executor wants recorded (a Slurm job submitted, its state changes) leave it through the `EventSink`
its caller passes; no executor knows where they go (the rollout's ledger, a terminal, nowhere).

The run's state lives on the nodes (pid file, exit code, per-rank status and heartbeat files), never in the
controller, so a controller that died can be replaced by a new one that polls, streams or stops the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from stepdeploy.remote.transport import Channel

RUNNING, EXITED, NOT_STARTED, UNREACHABLE = "running", "exited", "not-started", "unreachable"
EXIT_COLLECTIVE = 3  # train.py: a collective failed (a peer died or timed out)
EventSink = Callable[[str, dict[str, Any]], None]  # (one line for a person, the same as data)


def no_events(_message: str, _data: dict[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class Target:
    """One node of the run: how to reach it (its channel) and where its part lives."""

    name: str
    channel: Channel
    node_dir: str  # relative to the run directory

    @property
    def log(self) -> str:
        return f"logs/{self.node_dir.rsplit('/', 1)[-1]}.log"


@dataclass(frozen=True)
class NodeResult:
    node: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class RankStatus:
    rank: int
    node: str
    pid: int | None
    state: str  # running | exited | died (status says running, process gone: killed outright)
    code: int | None = None
    reason: str = ""
    iteration: int | None = None  # last heartbeat
    heartbeat_age_s: float | None = None
    # what the node's launcher saw (launch_ranks.py; torchrun records neither): when this rank failed, the first of
    # its node (its node's clock), or the rank after whose failure the launcher stopped it (a victim, no cause)
    failed_first_at: float | None = None
    stopped_after_rank: int | None = None


@dataclass(frozen=True)
class NodeStatus:
    node: str
    state: str  # running | exited | not-started | unreachable
    exit_code: int | None = None
    ranks: tuple[RankStatus, ...] = ()
    detail: str = ""
    bad_records: dict[str, int] = field(default_factory=dict, hash=False)  # file -> records it wrote wrong
    silent_s: float | None = None  # unreachable: seconds since a poll first found it silent (0: this poll)


@dataclass(frozen=True)
class RunStatus:
    nodes: tuple[NodeStatus, ...]

    @property
    def running(self) -> bool:
        return any(n.state == RUNNING for n in self.nodes)

    @property
    def finished_ok(self) -> bool:
        return all(n.state == EXITED and n.exit_code == 0 for n in self.nodes)

    @property
    def ranks(self) -> list[RankStatus]:
        return sorted((r for n in self.nodes for r in n.ranks), key=lambda r: r.rank)

    def lost_nodes(self, after_s: float) -> list[NodeStatus]:
        """The unreachable nodes that count as lost: silent for `after_s` or more (a shorter silence may be a blip
        the run rides out), or at once when the silence is not measured (silent_s None: the node answered, its
        probe failed). Also when no node answers (a one-node run, the controller's own link): the controller
        cannot tell a blip from a loss before the timeout, and waits it out as for one silent node."""
        return [n for n in self.nodes if n.state == UNREACHABLE and (n.silent_s is None or n.silent_s >= after_s)]

    def culprits(self) -> list[str]:
        """Which node/rank brought the run down, first causes before consequences: the ranks whose launcher saw them
        fail first on their node (launch_ranks.py) earliest first, ranks it stopped after one failed left out."""
        found = [f"node {n.node}: unreachable ({n.detail})" for n in self.nodes if n.state == UNREACHABLE]
        causes = [r for r in self.ranks if r.stopped_after_rank is None]
        ranks = [(r, f"node {r.node} rank {r.rank}: died without exiting (pid {r.pid} gone; "
                     f"{_first_line(r.reason) or 'killed or crashed'})") for r in causes if r.state == "died"]
        ranks += [(r, f"node {r.node} rank {r.rank}: exited {r.code} ({_first_line(r.reason)})")
                  for r in causes if r.state == EXITED and r.code not in (0, EXIT_COLLECTIVE, 143)]
        ranks.sort(key=lambda item: (0, item[0].failed_first_at) if item[0].failed_first_at is not None else (1, 0.0))
        found += [line for _rank, line in ranks]
        if not found:  # only victims: report them
            found = [f"node {r.node} rank {r.rank}: exited {r.code} ({_first_line(r.reason)})"
                     for r in self.ranks if r.state == EXITED and r.code not in (0, None)]
        return found


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


@dataclass(frozen=True)
class StopResult:
    node: str
    ok: bool  # no process of the run is left on the node
    signalled: tuple[int, ...] = ()
    killed: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    detail: str = ""


@dataclass(frozen=True)
class CommandResult:
    node: str
    ok: bool
    exit_code: int | None
    stdout: str = ""
    stderr: str = ""


@dataclass
class LogCursor:
    """Where streaming left off in each node's log."""

    offsets: dict[str, int] = field(default_factory=dict)  # bytes of each node's log already read
    pending: dict[str, bytes] = field(default_factory=dict)  # an unfinished last line, as the node wrote it


class Executor(Protocol):
    """What every executor does. `targets` are the run's nodes in the manifest's order; every call answers
    per node and never raises across nodes; `targets=` narrows a call to some of them."""

    kind: str  # its name in the registry
    poll_interval_s: float  # how often a rollout polls it: a poll's cost (RolloutConfig.poll_interval_s overrides)
    run_id: str
    run_dir: str  # where the run lives on its nodes
    targets: list[Target]

    def describe(self, local_run: Path) -> list[str]: ...  # the dry run: what prepare and start would do

    def prepare(self, local_run: Path) -> list[NodeResult]: ...

    def start(self) -> list[NodeResult]: ...

    def poll(self) -> RunStatus: ...

    def logs(self, tail: int = 50) -> dict[str, list[str]]: ...

    def follow(self, emit: Callable[[str], None], cursor: LogCursor) -> list[NodeResult]: ...

    def stop(self, grace_s: float = 10.0, targets: list[Target] | None = None) -> list[StopResult]: ...

    def fetch(self, dest: Path) -> list[NodeResult]: ...

    def run_command(self, command: str, targets: list[Target] | None = None) -> list[CommandResult]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Executor: ...

    def __exit__(self, *_exc: object) -> None: ...
