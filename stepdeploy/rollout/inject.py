"""Fault injection during the soak: `--inject kill:rank=last@10m` and friends.

    kill:rank=R@T               kill -9 of rank R's worker process
    hang:rank=R@T               kill -STOP of rank R's worker process (it stays alive, its heartbeat stops)
    link-down:node=N@T[,for=D]  the node's training interface down for D (default 60 s), then up again
    node-loss:node=N@T[,for=D]  every process of the run on the node killed and its sshd stopped for D
                                (default 60 s); the simulated node is killed outright (its whole process tree)

R is a rank number, `first` or `last`; N a node's 1-based index in the run, its name, `first` or `last`;
T and D durations like 90s, 10m, 1h (T from the soak's start). Parsing is pure; the actions go through the
executor's run_command; `link-down` and `node-loss` through a FaultActions strategy the caller passes
(NodeFaults here, for real nodes; the CLI passes stepdeploy.sim.faults' for the simulated cluster, which acts
on the host: its network namespaces, its node processes). Every action is recorded in the ledger *before* it
is taken, so a resumed controller never fires an injection twice.

On the simulated cluster a node's eth0 carries both SSH and the training traffic, so `link-down` there cuts
the controller off from the node too; on real nodes the training fabric and the management network differ.
On real nodes `link-down` and `node-loss` run as a detached `setsid` script on the node that brings the
interface (sshd) back after D even if the SSH session that started it dies.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Cluster, Node
from stepdeploy.remote.executor import Executor, RunStatus

KINDS = ("kill", "hang", "link-down", "node-loss")
RANK_KINDS, NODE_KINDS = ("kill", "hang"), ("link-down", "node-loss")
DEFAULT_FOR_S = 60.0
# whole values: fullmatch (a `$` would let a trailing newline through)
_SPEC = re.compile(r"(?P<kind>[a-z-]+):(?P<target>[a-z]+)=(?P<value>[^@,\s]+)@(?P<at>[^,\s]+)(?P<opts>(,[^,\s]+)*)")
_DURATION = re.compile(r"(\d{1,9}(?:\.\d{1,9})?)(s|m|h)?")
_EXAMPLES = "kill:rank=last@10m, hang:rank=0@20m, link-down:node=2@30m,for=90s, node-loss:node=2@40m"


@dataclass(frozen=True)
class Injection:
    spec: str  # as given (the ledger's key: an injection fires once)
    kind: str
    at_s: float
    rank: int | str | None = None  # int, "first" or "last"
    node: int | str | None = None  # 1-based index, a name, "first" or "last"
    for_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec, "kind": self.kind, "at_s": self.at_s, "rank": self.rank, "node": self.node,
                "for_s": self.for_s}


def duration(text: str, what: str, spec: str) -> float:
    match = _DURATION.fullmatch(text)
    if not match:
        raise BadInput(f"--inject {spec!r}: {what} {text!r} is not a duration like 30s, 10m or 1h")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2) or "s"]


def parse(spec: str) -> Injection:
    """One `--inject` value -> Injection (BadInput with the valid forms on any mistake)."""
    text = spec.strip()
    match = _SPEC.fullmatch(text)
    if not match:
        raise BadInput(f"--inject {spec!r} is not KIND:rank=R@T or KIND:node=N@T[,for=D]; e.g. {_EXAMPLES}")
    kind, target, value = match["kind"], match["target"], match["value"]
    if kind not in KINDS:
        raise BadInput(f"--inject {spec!r}: unknown fault {kind!r}; choose one of {', '.join(KINDS)}")
    wanted = "rank" if kind in RANK_KINDS else "node"
    if target != wanted:
        raise BadInput(f"--inject {spec!r}: {kind} takes {wanted}=..., not {target}=...")
    at = duration(match["at"], "time", spec)
    opts = dict(_option(o, spec) for o in match["opts"].split(",") if o)
    if opts and kind in RANK_KINDS:
        raise BadInput(f"--inject {spec!r}: {kind} takes no options (for= is for link-down and node-loss)")
    unknown = sorted(set(opts) - {"for"})
    if unknown:
        raise BadInput(f"--inject {spec!r}: unknown option {unknown[0]!r}; the only option is for=DURATION")
    for_s = duration(opts["for"], "for", spec) if "for" in opts else (DEFAULT_FOR_S if kind in NODE_KINDS else None)
    if for_s is not None and for_s <= 0:
        raise BadInput(f"--inject {spec!r}: for= must be longer than 0 s")
    if kind in RANK_KINDS:
        return Injection(text, kind, at, rank=_rank(value, spec), for_s=None)
    return Injection(text, kind, at, node=_node(value), for_s=for_s)


def _option(text: str, spec: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not value:
        raise BadInput(f"--inject {spec!r}: option {text!r} is not KEY=VALUE (e.g. for=90s)")
    return key, value


def _rank(value: str, spec: str) -> int | str:
    if value in ("first", "last"):
        return value
    if value.isdigit():
        return int(value)
    raise BadInput(f"--inject {spec!r}: rank {value!r} is not a number, first or last")


def _node(value: str) -> int | str:
    return int(value) if value.isdigit() else value


def parse_all(specs: tuple[str, ...] | list[str]) -> list[Injection]:
    found = [parse(s) for s in specs]
    seen: set[str] = set()
    for inj in found:
        if inj.spec in seen:
            raise BadInput(f"--inject {inj.spec!r} given twice")
        seen.add(inj.spec)
    return found


def resolve_rank(inj: Injection, world: int) -> int:
    rank = 0 if inj.rank == "first" else world - 1 if inj.rank == "last" else int(inj.rank or 0)
    if not 0 <= rank < world:
        raise BadInput(f"--inject {inj.spec!r}: rank {rank} does not exist (world size {world})")
    return rank


def resolve_node(inj: Injection, nodes: list[str]) -> str:
    """The node an injection names, among the run's nodes in order."""
    if inj.node == "first":
        return nodes[0]
    if inj.node == "last":
        return nodes[-1]
    if isinstance(inj.node, int):
        if not 1 <= inj.node <= len(nodes):
            raise BadInput(f"--inject {inj.spec!r}: node {inj.node} does not exist (the run has {len(nodes)})")
        return nodes[inj.node - 1]
    if inj.node not in nodes:
        raise BadInput(f"--inject {inj.spec!r}: the run has no node {inj.node!r} ({', '.join(nodes)})")
    return str(inj.node)


def due(injections: list[Injection], started: float, now: float, fired: set[str]) -> list[Injection]:
    """Injections whose time has come and that have not fired yet, in time order."""
    return sorted((i for i in injections if i.spec not in fired and now >= started + i.at_s), key=lambda i: i.at_s)


# --- commands (pure: text) ------------------------------------------------------------------------------------
def run_pids_command(run_id: str) -> str:
    """Shell: the pids of every process carrying the run's STEPDEPLOY_RUN_ID (what executor.stop also finds)."""
    tag = shlex.quote(f"STEPDEPLOY_RUN_ID={run_id}")
    return (f"for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -qxF -- {tag} && "
            "echo ${p#/proc/}; done; true")


def kill_run_command(run_id: str) -> str:
    return f"for pid in $({run_pids_command(run_id)}); do kill -9 $pid 2>/dev/null; done; true"


def signal_rank_command(pid: int, signal: str) -> str:
    """kill -SIG of a rank's worker, checked to be a live process of this run first (no stale pid reuse)."""
    return f"kill -0 {int(pid)} && kill -{signal} {int(pid)}"


def guarded_link_down_command(iface: str, for_s: float) -> str:
    """Real nodes: a detached script takes the interface down and always brings it back."""
    i = shlex.quote(iface)
    script = f"ip link set {i} down; sleep {int(for_s)}; ip link set {i} up"
    return f"setsid sh -c {shlex.quote(script)} >/dev/null 2>&1 </dev/null & echo started"


def guarded_sshd_stop_command(for_s: float) -> str:
    """Real nodes: sshd stopped, and started again after `for_s` by a detached script."""
    script = ("systemctl stop ssh.socket ssh sshd 2>/dev/null; "
              f"sleep {int(for_s)}; systemctl start ssh 2>/dev/null || systemctl start sshd")
    return f"setsid sh -c {shlex.quote(script)} >/dev/null 2>&1 </dev/null & echo started"


# --- the node-level faults: a strategy (real nodes here; the simulated cluster's in stepdeploy/sim/faults.py) --
class FaultActions(Protocol):
    """How `link-down` and `node-loss` act on a node; each returns (ok, what was done). The run's processes on
    a lost node are killed by the Injector before `node_loss` (through the executor, for every strategy)."""

    def link_down(self, executor: Executor, node: Node, iface: str, for_s: float) -> tuple[bool, str]: ...

    def node_loss(self, executor: Executor, node: Node, for_s: float) -> tuple[bool, str]: ...


def run_on(executor: Executor, node: str, command: str) -> tuple[bool, str]:
    """`command` on one node of the run through the executor: (ok, its output's last 300 characters)."""
    targets = [t for t in executor.targets if t.name == node]
    result = executor.run_command(command, targets)[0]
    return result.ok, (result.stdout.strip() or result.stderr.strip())[-300:]


class NodeFaults:
    """Real nodes: a detached script on the node acts and always undoes it after D, even if SSH dies."""

    def link_down(self, executor: Executor, node: Node, iface: str, for_s: float) -> tuple[bool, str]:
        ok, out = run_on(executor, node.name, guarded_link_down_command(iface, for_s))
        return ok, f"{iface} down on {node.name} for {for_s:.0f} s (guarded on the node)" + ("" if ok else out)

    def node_loss(self, executor: Executor, node: Node, for_s: float) -> tuple[bool, str]:
        ok, out = run_on(executor, node.name, guarded_sshd_stop_command(for_s))
        return ok, f"sshd stopped on {node.name} for {for_s:.0f} s" + ("" if ok else f": {out}")


# --- firing (side effects; called from the soak's follow loop) --------------------------------------------------
class Injector:
    """Fires the due injections of a soak through `executor`, each recorded (through `record`, the stage's event
    sink) before it acts."""

    def __init__(self, injections: list[Injection], *, record: Callable[[str, dict[str, Any]], None],
                 fired: set[str], cluster: Cluster, executor: Executor, started: float,
                 faults: FaultActions | None = None) -> None:
        """`record(message, data)`: an `inject` event in the ledger; `fired`: the specs earlier attempts (or an
        earlier controller) already fired -- an injection fires once; `faults`: how link-down and node-loss act
        (None: on real nodes, NodeFaults)."""
        self.injections, self.record, self.fired = injections, record, set(fired)
        self.cluster, self.executor, self.started = cluster, executor, started
        self.faults: FaultActions = faults or NodeFaults()

    def tick(self, status: RunStatus, now: float) -> list[str]:
        """Fire what is due; returns one line per injection fired."""
        lines = []
        for inj in due(self.injections, self.started, now, self.fired):
            target = self._target(inj, status)
            if target is None:
                continue  # its rank has not started yet (or is between attempts): try on the next poll
            self.fired.add(inj.spec)
            self.record(f"injecting {inj.spec} on {target['node']}"
                        + (f" (rank {target['rank']}, pid {target['pid']})" if "rank" in target else ""),
                        {**inj.to_json(), **target, "time": now})
            ok, detail = self._act(inj, target)
            self.record(f"{inj.spec}: {'done' if ok else 'FAILED'}: {detail}",
                        {"spec_result": inj.spec, "ok": ok, "detail": detail})
            lines.append(f"injected {inj.spec}: {detail}")
        return lines

    def _target(self, inj: Injection, status: RunStatus) -> dict[str, Any] | None:
        """Whom to hit, once the run trains (a heartbeat: a fault during start-up tests no recovery from a
        checkpoint); None: not yet, try on the next poll."""
        ranks = status.ranks
        if not any(r.state == "running" and r.iteration is not None for r in ranks):
            return None
        if inj.kind in RANK_KINDS:
            rank = resolve_rank(inj, max(r.rank for r in ranks) + 1)
            found = next((r for r in ranks if r.rank == rank and r.state == "running" and r.pid
                          and r.iteration is not None), None)
            return None if found is None else {"node": found.node, "rank": rank, "pid": found.pid}
        return {"node": resolve_node(inj, [n.node for n in status.nodes])}

    def _act(self, inj: Injection, target: dict[str, Any]) -> tuple[bool, str]:
        node = target["node"]
        if inj.kind in RANK_KINDS:
            sig = "9" if inj.kind == "kill" else "STOP"
            ok, out = run_on(self.executor, node, signal_rank_command(target["pid"], sig))
            return ok, f"kill -{sig} {target['pid']} on {node}" + ("" if ok else f": {out}")
        inventory_node = self.cluster.node(node)
        for_s = float(inj.for_s or DEFAULT_FOR_S)
        if inj.kind == "link-down":
            return self.faults.link_down(self.executor, inventory_node, inventory_node.train_iface or "eth0", for_s)
        ok, out = run_on(self.executor, node, kill_run_command(self.executor.run_id))
        lost, detail = self.faults.node_loss(self.executor, inventory_node, for_s)
        return ok and lost, f"run's processes killed ({'ok' if ok else out}), {detail}"
