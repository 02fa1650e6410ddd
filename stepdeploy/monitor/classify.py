"""Classify a failed run: crash, hang, link or node-loss, with the evidence, first causes before consequences.

Rules, in order (the first that holds wins):
  node-loss  a node is unreachable and lost: silent for the heartbeat timeout (RunStatus.lost_nodes), or silent
             for less while the run shows it did not ride the silence out (a rank elsewhere exited on a failed
             collective or hangs past the timeout, the monitor reports a hang, or no rank that answers runs any
             more): those ranks waited on the silent node, so they are its consequences, never a `link` or `hang`
             of their own. A rank that answers and died or failed on its own is a crash first (below). A shorter
             silence the run rides out (a link blip: the node answers again, training goes on) is no failure.
  link       a monitor finding fails a link (IB port not ACTIVE, interface not up, link_downed rose, or a link that
             flapped while ranks failed); a flap the run trained through is a warning finding, not weighed here
  crash      a rank died without exiting (killed, segfault) or exited with its own error (not a collective
             failure, not SIGTERM from the stop, not stopped by its launcher after another rank failed); the culprit
             is the rank whose launcher saw it fail earliest (launch_ranks.py's record), else (torchrun records
             nothing) the rank that exited with its own error, else the died rank with the lowest iteration
  hang       a running rank's heartbeat is older than the timeout, or the monitor reported a hang
  link       ranks exited only because their collectives failed, with no rank dead, crashed or stuck: the
             peers' collectives timed out on the network
Nothing holds: None (the run is healthy or finished cleanly).
"""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.monitor.model import Finding, Severity
from stepdeploy.remote.executor import EXIT_COLLECTIVE, EXITED, RUNNING, UNREACHABLE, NodeStatus, RankStatus, RunStatus

CRASH, HANG, LINK, NODE_LOSS = "crash", "hang", "link", "node-loss"
NOT_A_CAUSE = (0, EXIT_COLLECTIVE, 143, None)  # 143: SIGTERM, what a stop sends


@dataclass(frozen=True)
class Classification:
    kind: str
    node: str | None
    rank: int | None
    evidence: tuple[str, ...]

    def to_json(self) -> dict:
        return {"kind": self.kind, "node": self.node, "rank": self.rank, "evidence": list(self.evidence)}


def classify(status: RunStatus, findings: list[Finding] | tuple[Finding, ...] = (),
             heartbeat_timeout_s: float = 180.0) -> Classification | None:
    """The failure's kind and culprit from the executor's poll and the monitor's findings."""
    for rule in (_node_loss, _link_finding, _crash, _hang, _collective_only):
        result = rule(status, list(findings), heartbeat_timeout_s)
        if result is not None:
            return _with_node_findings(result, findings)
    return None


def _with_node_findings(result: Classification, findings: list[Finding] | tuple[Finding, ...]) -> Classification:
    """Add the culprit node's hardware failures (an XID 79 behind a crash) to the evidence."""
    extra = tuple(f"monitor: {f.node} {f.subject}: {f.message}" for f in findings
                  if f.severity is Severity.FAIL and f.node == result.node and f.kind not in ("link", "hang")
                  and f"monitor: {f.node} {f.subject}: {f.message}" not in result.evidence)
    return Classification(result.kind, result.node, result.rank, result.evidence + extra)


def _reason(rank: RankStatus) -> str:
    return rank.reason.splitlines()[0] if rank.reason else ""


def _node_loss(status: RunStatus, findings: list[Finding], timeout: float) -> Classification | None:
    silent = [n for n in status.nodes if n.state == UNREACHABLE]
    if not silent:
        return None
    lost = status.lost_nodes(timeout)
    if lost:
        return Classification(NODE_LOSS, lost[0].node, None, _unreachable(lost))
    if _crash(status, findings, timeout) is not None:
        return None  # a rank that answers died or failed on its own: a cause of its own, the crash rule names it
    stalled = _stalled(status, findings, timeout)
    if not stalled:
        return None  # silent for less than the timeout and the run rides it out (so far): a blip, not a loss
    why = f"the run did not ride out the silence (under the {timeout:.0f} s timeout):"
    return Classification(NODE_LOSS, silent[0].node, None, (*_unreachable(silent), why, *stalled))


def _unreachable(nodes: list[NodeStatus]) -> tuple[str, ...]:
    return tuple(f"node {n.node} unreachable: {n.detail or 'no answer'}" for n in nodes)


def _stalled(status: RunStatus, findings: list[Finding], timeout: float) -> tuple[str, ...]:
    """What shows the run stopped while a node is silent: ranks that exited on a failed collective, running ranks
    without a heartbeat past the timeout, the monitor's hang findings, or no rank that answers running any more."""
    ranks = status.ranks
    found = [f"rank {r.rank} on {r.node}: exited {r.code} ({_reason(r) or 'collective failed'})"
             for r in ranks if r.state == EXITED and r.code == EXIT_COLLECTIVE]
    found += [f"rank {r.rank} on {r.node}: no heartbeat for {r.heartbeat_age_s:.0f} s, at iteration {r.iteration}"
              for r in ranks if r.state == RUNNING and r.heartbeat_age_s is not None and r.heartbeat_age_s > timeout]
    found += [f"monitor: {f.node} {f.subject}: {f.message}" for f in findings if f.kind == "hang"]
    if not found and ranks and not any(r.state == RUNNING for r in ranks):
        found.append(f"no rank runs any more on {', '.join(sorted({r.node for r in ranks}))} (exit codes "
                     f"{', '.join(str(r.code) for r in ranks)})")
    return tuple(found)


def _link_finding(status: RunStatus, findings: list[Finding], timeout: float) -> Classification | None:
    links = [f for f in findings if f.severity is Severity.FAIL
             and (f.kind == "link" or (f.kind == "ib_counter" and f.message.startswith("link_downed")))]
    if not links:
        return None
    victims = [f"rank {r.rank} on {r.node}: exited {r.code} (collective failed)"
               for r in status.ranks if r.state == EXITED and r.code == EXIT_COLLECTIVE]
    return Classification(LINK, links[0].node or None, None,
                          tuple(f"monitor: {f.node} {f.subject}: {f.message}" for f in links) + tuple(victims))


def _crash(status: RunStatus, findings: list[Finding], timeout: float) -> Classification | None:
    causes = [r for r in status.ranks if r.stopped_after_rank is None]  # its launcher stopped it: a victim
    died = [r for r in causes if r.state == "died"]
    failed = [r for r in causes if r.state == EXITED and r.code not in NOT_A_CAUSE]
    if not died and not failed:
        return None
    evidence = [(r, f"rank {r.rank} on {r.node}: exited {r.code} ({_reason(r)})") for r in failed]
    evidence += [(r, f"rank {r.rank} on {r.node}: died without exiting (pid {r.pid} gone; "
                     f"{_reason(r) or 'killed or crashed'}), last heartbeat at iteration {r.iteration}") for r in died]
    seen = [r for r in (*failed, *died) if r.failed_first_at is not None]
    if seen:
        # Each node's launcher (launch_ranks.py) wrote when it saw its first rank fail: the earliest is the cause,
        # whatever else one poll finds dead with it (srun --kill-on-bad-exit kills every node's task ~50 ms after
        # the first node's launcher exits, before the next poll). Its evidence comes first.
        first = min(seen, key=lambda r: (r.failed_first_at, r.rank))
        evidence.sort(key=lambda item: item[0] is not first)
    else:
        first = failed[0] if failed else min(died, key=lambda r: (r.iteration if r.iteration is not None else -1,
                                                                    r.rank))
    return Classification(CRASH, first.node, first.rank, tuple(line for _rank, line in evidence))


def _hang(status: RunStatus, findings: list[Finding], timeout: float) -> Classification | None:
    stuck = [r for r in status.ranks if r.state == RUNNING and r.heartbeat_age_s is not None
             and r.heartbeat_age_s > timeout]
    reported = [f for f in findings if f.kind == "hang"]
    if not stuck and not reported:
        return None
    evidence = tuple(f"rank {r.rank} on {r.node}: no heartbeat for {r.heartbeat_age_s:.0f} s (timeout {timeout:.0f} s),"
                     f" at iteration {r.iteration}" for r in stuck)
    evidence += tuple(f"monitor: {f.node} {f.subject}: {f.message}" for f in reported)
    if stuck:  # the rank that stopped first holds the others in their collectives: oldest iteration, oldest beat
        first = min(stuck, key=lambda r: (r.iteration if r.iteration is not None else -1, -(r.heartbeat_age_s or 0)))
        return Classification(HANG, first.node, first.rank, evidence)
    rank = int(reported[0].subject.split()[-1]) if reported[0].subject.startswith("rank ") else None
    return Classification(HANG, reported[0].node or None, rank, evidence)


def _collective_only(status: RunStatus, findings: list[Finding], timeout: float) -> Classification | None:
    victims = [r for r in status.ranks if r.state == EXITED and r.code == EXIT_COLLECTIVE]
    if not victims:
        return None
    evidence = tuple(f"rank {r.rank} on {r.node}: exited {r.code} ({_reason(r) or 'collective failed'})"
                     for r in victims)
    nodes = {r.node for r in victims}
    node = next(iter(nodes)) if len(nodes) == 1 else None
    return Classification(LINK, node, None,
                          ("collectives failed with no rank dead, crashed or stuck: the network between the "
                           "nodes", *evidence))
