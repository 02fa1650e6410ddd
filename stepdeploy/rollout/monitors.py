"""The soak's collector loop and failure decision.

Every `monitor_interval_s` the monitor's probe (stepdeploy.monitor.probe) runs on every reachable node
through the executor's run_command; each node's sample is judged against that node's previous sample
(hardware + training judgements: deltas, never totals), findings go to the ledger, and the Prometheus
textfile in <run dir>/monitor/stepdeploy.prom is rewritten. `decide()` (pure) says when a run in flight has
failed and how (crash, hang, link, node-loss), from the executor's poll and the findings; `grade_flaps()` (pure)
says whether a link that flapped between two samples failed the run or only warns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepdeploy.monitor import classify, judge, probe, prometheus, training
from stepdeploy.monitor.classify import Classification
from stepdeploy.monitor.model import Finding, MonitorLimits, NodeSample, Severity
from stepdeploy.remote.executor import EXIT_COLLECTIVE, EXITED, RUNNING, UNREACHABLE, Executor, RunStatus
from stepdeploy.render.manifest import Manifest

MAX_FINDING_EVENTS = 20  # per round: a flood (every counter of a flapping port) is summarised, not copied


def judge_round(prev: dict[str, NodeSample], current: list[NodeSample], limits: MonitorLimits) -> list[Finding]:
    """Findings of one collection round: each node against its previous sample (none on its first)."""
    found: list[Finding] = []
    for cur in current:
        before = prev.get(cur.node)
        if before is not None:
            found += judge.judge_node(before, cur, limits) + training.judge_training(before, cur, limits)
    return found


def not_training(status: RunStatus, heartbeat_timeout_s: float) -> list[str]:
    """What shows the run did not train on (empty: it did): a rank that died or exited with an error (a failed
    collective included), a running rank whose heartbeat is older than the timeout."""
    found = [f"rank {r.rank} on {r.node}: exited {r.code}" for r in status.ranks
             if r.state == EXITED and r.code not in (0, None)]
    found += [f"rank {r.rank} on {r.node}: died" for r in status.ranks if r.state == "died"]
    found += [f"rank {r.rank} on {r.node}: no heartbeat for {r.heartbeat_age_s:.0f} s" for r in status.ranks
              if r.state == RUNNING and r.heartbeat_age_s is not None and r.heartbeat_age_s > heartbeat_timeout_s]
    return found


def grade_flaps(found: list[Finding], status: RunStatus, heartbeat_timeout_s: float) -> list[Finding]:
    """A link that went down and came up again between two samples (the judge's `link` warning) stays a warning
    while the run trained on through it (a blip TCP rode out: recorded, shown in the report, no restart), and is
    a failure, acted on at once, when the poll of the same round shows ranks failing or stuck."""
    failing = not_training(status, heartbeat_timeout_s)
    graded = []
    for f in found:
        if f.kind == "link" and f.severity is Severity.WARN:
            if failing:
                f = Finding(f.kind, Severity.FAIL, f.subject, f"{f.message}; the run did not train on: {failing[0]}",
                            f.node, f.fix)
            else:
                f = Finding(f.kind, f.severity, f.subject, f"{f.message}; the run trained on (heartbeats within "
                            f"{heartbeat_timeout_s:.0f} s, no collective failed): a warning, no restart", f.node, f.fix)
        graded.append(f)
    return graded


def decide(status: RunStatus, findings: list[Finding], heartbeat_timeout_s: float,
           proc_states: dict[int, str] | None = None) -> Classification | None:
    """The failure of a run in flight, or None while it is healthy (or its fate is not yet clear).

    A crash, a hang and a link failure (a port or interface not up, link_downed rose, or a flap while ranks
    failed: grade_flaps) are acted on at once; a flap the run trained through is a warning, not in `findings`.
    An unreachable node is acted on once it is lost: silent for the heartbeat timeout, or at once when the run
    shows it did not ride the silence out (classify's node-loss rule); a shorter silence the run rides out (a
    link blip) is no failure. Ranks that exited only because their collectives failed (code 3) are a
    consequence: while another rank still runs, it may be the stuck one (a hang is declared when its heartbeat
    passes the timeout), so `link` from exits alone is decided only once nothing of the run runs any more.
    `proc_states` (rank -> process state, from the monitor) names the culprit of a hang: a stopped (T) or
    uninterruptible (D) rank, not its sleeping peers."""
    verdict = classify.classify(status, findings, heartbeat_timeout_s)
    if verdict is None:
        return None
    if verdict.kind == classify.HANG:
        return _stuck_culprit(status, verdict, proc_states or {})
    link_from_exits = verdict.kind == classify.LINK and not any(
        f.kind == "link" or f.message.startswith("link_downed") for f in findings if f.severity is Severity.FAIL)
    if link_from_exits and status.running:
        return None
    return verdict


def _stuck_culprit(status: RunStatus, verdict: Classification, states: dict[int, str]) -> Classification:
    """All ranks' heartbeats stop when one stops (the others wait for it in a collective); the process
    state tells which one is not waiting."""
    frozen = [r for r in status.ranks if r.state == RUNNING and states.get(r.rank, "")[:1] in ("T", "t", "D")]
    if not frozen or (verdict.rank is not None and verdict.rank in {r.rank for r in frozen}):
        return verdict
    first = frozen[0]
    why = {"D": "uninterruptible (D)"}.get(states[first.rank][:1], "stopped (T)")
    return Classification(classify.HANG, first.node, first.rank,
                          (f"rank {first.rank} on {first.node}: process {first.pid} is {why} while its peers wait "
                           f"in their collectives", *verdict.evidence))


def fail_findings(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity is Severity.FAIL]


def progress_iteration(status: RunStatus) -> int | None:
    """The furthest iteration any rank's heartbeat reached (None: no rank beat yet)."""
    its = [r.iteration for r in status.ranks if r.iteration is not None]
    return max(its) if its else None


def unreachable_nodes(status: RunStatus) -> list[str]:
    return [n.node for n in status.nodes if n.state == UNREACHABLE]


def collective_victims(status: RunStatus) -> list[int]:
    return [r.rank for r in status.ranks if r.state == EXITED and r.code == EXIT_COLLECTIVE]


class SoakMonitor:
    """Runs the probe on the run's nodes, keeps each node's previous sample, records what it finds."""

    def __init__(self, executor: Executor, spec: probe.ProbeSpec, textfile: Path, limits: MonitorLimits,
                 record: Callable[[str, str, dict[str, Any]], None], interval_s: float) -> None:
        self.executor, self.spec, self.textfile, self.limits = executor, spec, textfile, limits
        self.record, self.interval_s = record, interval_s
        self.prev: dict[str, NodeSample] = {}
        self.findings: list[Finding] = []  # everything found during this attempt
        self.rounds, self.last = 0, 0.0

    def proc_states(self) -> dict[int, str]:
        return {rank: state for sample in self.prev.values() for rank, state in sample.rank_proc_states.items()}

    def maybe_collect(self, status: RunStatus, now: float | None = None) -> list[Finding]:
        now = time.time() if now is None else now
        if now - self.last < self.interval_s:
            return []
        self.last = now
        return self.collect(status, now)

    def collect(self, status: RunStatus, now: float) -> list[Finding]:
        """One round on the nodes the poll could reach (an unreachable node would hold the round up)."""
        lost = set(unreachable_nodes(status))
        targets = [t for t in self.executor.targets if t.name not in lost]
        if not targets:
            return []
        results = self.executor.run_command(probe.remote_command(self.spec), targets)
        samples = [probe.parse(r.stdout, r.node, self.spec, now) for r in results if r.exit_code is not None]
        found = grade_flaps(judge_round(self.prev, samples, self.limits), status, self.limits.heartbeat_timeout_s)
        for sample in samples:
            self.prev[sample.node] = sample
        self.rounds += 1
        self.findings += found
        self._report(found)
        prometheus.write_textfile(self.textfile, prometheus.render(self.prev.values()))
        return found

    def _report(self, found: list[Finding]) -> None:
        for f in found[:MAX_FINDING_EVENTS]:
            self.record("monitor", f"{f.severity.value}: {f.node} {f.subject}: {f.message}", f.to_json())
        if len(found) > MAX_FINDING_EVENTS:
            self.record("monitor", f"{len(found) - MAX_FINDING_EVENTS} more finding(s) this round",
                        {"count": len(found)})


def probe_spec(manifest: Manifest, train_iface: str | None) -> probe.ProbeSpec:
    """What the soak's monitor reads: the run's files, its checkpoint disk, its training interface."""
    run_dir = manifest.run_dir
    return probe.ProbeSpec(run_dir=run_dir, checkpoint_dir=f"{run_dir}/out",
                           ifaces=(train_iface,) if train_iface else ())
