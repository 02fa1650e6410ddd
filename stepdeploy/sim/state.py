"""The simulated cluster's state file: every resource it creates is recorded *before* it is created, so
`sim down` can remove exactly those (and nothing else), even after a crash half-way through `sim up`."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_VERSION = 1


@dataclass
class NodeState:
    index: int
    name: str
    address: str
    netns: str
    veth: str
    root: str  # overlay mount point (the node's /)
    pid: int | None = None  # the `unshare` process; its child is the node's PID 1
    pid_start: int | None = None  # /proc/PID/stat start time, to never kill a reused PID


@dataclass
class SimState:
    name: str
    subnet: str
    bridge: str
    bridge_address: str
    http_port: int
    base: str
    nodes: list[NodeState] = field(default_factory=list)
    http_pid: int | None = None
    http_pid_start: int | None = None
    version: int = STATE_VERSION

    @classmethod
    def from_json(cls, data: dict) -> SimState:
        nodes = [NodeState(**n) for n in data.pop("nodes", [])]
        return cls(nodes=nodes, **data)

    def node(self, name: str) -> NodeState | None:
        return next((n for n in self.nodes if n.name == name), None)


def state_file(state_dir: Path) -> Path:
    return state_dir / "state.json"


def load_state(state_dir: Path) -> SimState | None:
    try:
        return SimState.from_json(json.loads(state_file(state_dir).read_text()))
    except FileNotFoundError:
        return None


def save(state_dir: Path, state: SimState) -> None:
    """Atomic replace: a reader (or a crash) sees the old or the new state, never half of one."""
    path = state_file(state_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2) + "\n")
    os.replace(tmp, path)


def remove(state_dir: Path) -> None:
    state_file(state_dir).unlink(missing_ok=True)


@contextlib.contextmanager
def locked(state_dir: Path) -> Iterator[None]:
    """One `sim up`/`sim down` at a time per cluster."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), or None if there is no such live process.

    A zombie counts as gone: it runs nothing, and its parent (not always us: a process whose `sim up` has
    exited belongs to init, which need not reap it promptly in a container) may keep it for a while.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_ours(pid: int | None, start: int | None) -> bool:
    return pid is not None and start is not None and process_start_time(pid) == start
