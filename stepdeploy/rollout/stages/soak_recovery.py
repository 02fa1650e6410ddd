"""After a soak run failed: stop everything (and show it), wait for lost nodes, diagnose the failed attempt's
log lines, clear the rank files for the next attempt. Every step is a ledger event of the soak; the attempt
service's clock (rollout/clock.py) times the node wait."""

from __future__ import annotations

from stepdeploy.monitor import classify, diagnose
from stepdeploy.monitor.classify import Classification
from stepdeploy.remote.executor import Executor, RunStatus
from stepdeploy.rollout import monitors
from stepdeploy.rollout.config import StageFailed, StageStopped
from stepdeploy.rollout.recovery import LOG_TAIL, attempt_log_lines
from stepdeploy.rollout.service import SWEEP_STAGING, AttemptService

# a new attempt must not read the last one's rank files; a save in flight when the run was stopped or killed
# left a staging directory (the rank removes its own on a stop, not when killed): never committed, it only takes
# room (issue 36). Run only once the stop is proven (no process of the run left to write into it).
CLEAR_RANK_FILES = f"rm -f -- out/status/rank* out/heartbeat/rank* && {SWEEP_STAGING}"
NAME = "soak"  # the stage these steps belong to (its events, its attempts)


def recover(service: AttemptService, executor: Executor, monitor: monitors.SoakMonitor,
            verdict: Classification | None) -> list[diagnose.Diagnosis]:
    """Stop everything (and show it), wait for lost nodes, diagnose, clear the rank files for the next attempt;
    returns the diagnosis (a full disk ends the soak: a restart cannot fix it)."""
    stop_and_prove(service, executor)
    lost = monitors.unreachable_nodes(executor.poll())
    if lost:
        if not wait_for_nodes(service, executor, lost):
            raise StageFailed(f"soak: node(s) {', '.join(lost)} lost and not back within "
                              f"{service.config.node_wait_s:.0f} s")
        status = executor.poll()  # the node is back: what do its counters say now?
        stop_and_prove(service, executor)
        clear_rank_files(executor)  # its dead ranks' files would read as hung ranks
        verdict = reclassify(service, monitor, status, verdict) or verdict
    found = diagnose_attempt(service, executor, verdict)
    node = verdict.node if verdict else None
    service.event(NAME, "preflight", f"preflight of the suspect node {node or '(none)'} skipped: the soak restarts on "
                  "the same nodes; run `stepdeploy preflight` on it if the failure repeats", {"node": node})
    clear_rank_files(executor)
    return found


def clear_rank_files(executor: Executor) -> None:
    bad = [c.node for c in executor.run_command(CLEAR_RANK_FILES) if not c.ok]
    if bad:
        raise StageFailed(f"soak: cannot clear the rank files on {', '.join(bad)} before the restart")


def stop_and_prove(service: AttemptService, executor: Executor) -> None:
    stops = executor.stop()
    left = {s.node: list(s.left) for s in stops if s.left}
    unreachable = [s.node for s in stops if not s.ok and not s.left]
    parts = [f"{s.node}: {s.detail}" for s in stops]
    service.event(NAME, "stop", "stop: " + "; ".join(parts),
                  {"ok": all(s.ok for s in stops), "left": left, "unreachable": unreachable,
                   "killed": {s.node: list(s.killed) for s in stops}})
    if left:
        raise StageFailed(f"soak: processes of the run survived the stop: {left}")


def wait_for_nodes(service: AttemptService, executor: Executor, lost: list[str]) -> bool:
    """Poll until the lost nodes answer again (True) or node_wait_s passes (False); a stop request ends the
    wait (StageStopped)."""
    clock, wait_s, names = service.clock, service.config.node_wait_s, ", ".join(lost)
    service.event(NAME, "node-wait", f"waiting up to {wait_s:.0f} s for {names} to come back", {})
    until = clock.time() + wait_s
    while clock.time() < until:
        if service.stop_requested():
            raise StageStopped(f"soak: stopped on request while waiting for {names}")
        still = monitors.unreachable_nodes(executor.poll())
        if not still:
            service.event(NAME, "node-wait", f"{names} reachable again", {"time": clock.time()})
            return True
        clock.sleep(2.0)
    service.event(NAME, "node-wait", f"{names} still unreachable after {wait_s:.0f} s", {})
    return False


def reclassify(service: AttemptService, monitor: monitors.SoakMonitor, status: RunStatus,
               verdict: Classification | None) -> Classification | None:
    """A node that was unreachable and came back was not necessarily lost: its interface may have gone down
    (the simulated nodes carry SSH and training on one interface). Its counters and ranks decide."""
    if verdict is None or verdict.kind != classify.NODE_LOSS:
        return None
    found = monitor.collect(status, service.clock.time())
    flapped = [f for f in found if f.kind == "link" and f.severity.value == "fail"]
    if not flapped:
        service.event(NAME, "classified", f"node-loss confirmed for {verdict.node}: no link flap recorded on its "
                      "return", verdict.to_json())
        return None
    again = Classification(classify.LINK, verdict.node, None,
                           tuple(f"monitor: {f.node} {f.subject}: {f.message}" for f in flapped) + verdict.evidence)
    service.event(NAME, "classified", f"re-classified as link: {again.evidence[0]}", again.to_json())
    return again


def diagnose_attempt(service: AttemptService, executor: Executor, verdict: Classification | None
                     ) -> list[diagnose.Diagnosis]:
    """Known signatures in the failed attempt's lines of the culprit's log (every node's without a culprit)."""
    nodes = [verdict.node] if verdict and verdict.node else [t.name for t in executor.targets]
    found = diagnose.diagnose("\n".join(attempt_log_lines(executor, nodes)))
    if not found:
        service.event(NAME, "diagnosis", f"no known failure signature in this attempt's last {LOG_TAIL} log lines "
                      f"of {', '.join(nodes)}", {"nodes": nodes, "diagnoses": []})
        return []
    service.event(NAME, "diagnosis", "; ".join(f"{d.signature}: {d.cause}" for d in found),
                  {"nodes": nodes, "diagnoses": [d.to_json() for d in found]})
    return found
