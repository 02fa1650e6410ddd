"""The simulated cluster's `link-down` and `node-loss` (rollout/inject.py's FaultActions, passed in by the CLI
when the inventory is the one `sim up` wrote): they act from the host, where the nodes live.

On the simulated cluster a node's eth0 carries both SSH and the training traffic, so `link-down` cuts the
controller off from the node too. `node-loss` kills the node's whole process tree (sshd included), as a power
loss would. Each is undone by a detached host process after D, even if the controller dies meanwhile."""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdeploy.sim import node as simnode
from stepdeploy.sim import state as simstate


@dataclass(frozen=True)
class SimNode:
    state_dir: Path
    name: str
    netns: str


def sim_node(state_dir: Path, node: str, address: str) -> SimNode | None:
    """The simulated node behind an inventory host (same name and address), or None."""
    sim = simstate.load_state(state_dir)
    found = sim.node(node) if sim else None
    if found is None or found.address != address:
        return None
    return SimNode(state_dir, found.name, found.netns)


def for_cluster(cluster: Any) -> SimFaults | None:
    """The simulated faults when every node of the inventory is a node of the simulated cluster whose state
    lies beside it (`sim up` writes the inventory there), else None (real nodes)."""
    state_dir = Path(cluster.source).resolve().parent
    if not cluster.nodes or any(sim_node(state_dir, n.name, n.address) is None for n in cluster.nodes):
        return None
    return SimFaults(state_dir)


class SimFaults:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def _node(self, node: Any) -> SimNode:
        found = sim_node(self.state_dir, node.name, node.address)
        if found is None:
            raise RuntimeError(f"{node.name} is not a node of the simulated cluster in {self.state_dir}")
        return found

    def link_down(self, executor: Any, node: Any, iface: str, for_s: float) -> tuple[bool, str]:
        sim = self._node(node)
        res = link(sim.netns, iface, up=False)
        if res.returncode != 0:
            return False, f"ip -n {sim.netns} link set {iface} down: {res.stderr.strip()}"
        link_guard(sim.netns, iface, for_s)
        return True, f"ip -n {sim.netns} link set {iface} down; up again in {for_s:.0f} s"

    def node_loss(self, executor: Any, node: Any, for_s: float) -> tuple[bool, str]:
        sim = self._node(node)
        kill_node(sim)
        revive_guard(sim, for_s)
        return True, f"simulated node {node.name} killed (sshd and every process); it starts again in {for_s:.0f} s"


def link(netns: str, iface: str, up: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "-n", netns, "link", "set", iface, "up" if up else "down"], capture_output=True,
                          text=True, check=False)


def link_guard(netns: str, iface: str, for_s: float) -> None:
    """A detached host process that brings the link back after `for_s`, even if the controller dies."""
    script = f"sleep {int(for_s)}; ip -n {shlex.quote(netns)} link set {shlex.quote(iface)} up"
    subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)


def kill_node(node: SimNode) -> None:
    """The node is gone: its whole process tree (sshd included) killed, as a power loss would."""
    sim = simstate.load_state(node.state_dir)
    found = sim.node(node.name) if sim else None
    if found is not None:
        simnode.stop(found)


def revive_guard(node: SimNode, for_s: float) -> None:
    """A detached host process that starts the simulated node again after `for_s` (`sim up` of its cluster)."""
    code = ("import sys, time; from pathlib import Path; time.sleep(float(sys.argv[1])); "
            "from stepdeploy.sim import state; from stepdeploy.sim.cluster import SimConfig, up; "
            "s = state.load_state(Path(sys.argv[2])); "
            "up(SimConfig(name=s.name, subnet=s.subnet, http_port=s.http_port, state_dir=Path(sys.argv[2])), "
            "len(s.nodes))")
    log = open(node.state_dir / f"revive-{node.name}.log", "ab")  # noqa: SIM115 (handed to the child)
    with log:
        subprocess.Popen([sys.executable, "-c", code, str(for_s), str(node.state_dir)], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=log, start_new_session=True)
