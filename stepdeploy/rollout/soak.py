"""The soak stage: the target configuration for a duration, checkpointing periodically; a failed run is
restarted from its last complete checkpoint (the same run directory: the workload resumes from `latest`)
up to a maximum number of restarts. The soak clock is the stage's first start in the ledger, so a resumed
controller continues the same soak rather than starting a new one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepdeploy.rollout import gates
from stepdeploy.rollout.attempt import executor_for, render_attempt
from stepdeploy.rollout.config import StageFailed
from stepdeploy.rollout.ladder import target_rung

if TYPE_CHECKING:
    from stepdeploy.rollout.runner import Rollout

SOAK_ITERATIONS = 10**9  # the soak ends by time, not by count


def run_soak(r: Rollout) -> None:
    rung = target_rung(r.cluster, r.config.model)
    stage = next(s for s in r.ledger.stages(r.run_id) if s.name == "soak")
    deadline = (stage.started or time.time()) + r.config.soak_duration_s
    local = _soak_dir(r, rung)
    while True:
        attempts = r.ledger.attempts(r.run_id, "soak")
        restarts = sum(1 for a in attempts if a["status"] == "failed")
        current = attempts[-1] if attempts and attempts[-1]["status"] == "running" else None
        alive = current is not None and _alive(r, local)
        if current is not None and not alive:  # it died while no controller watched: a failure, restart it
            r.ledger.finish_attempt(current["id"], "failed", {"why": "processes gone while no controller ran"})
            continue
        attempt = current["id"] if current else r.ledger.start_attempt(
            r.run_id, "soak", rung.name, {"local_run": str(local), "rung": rung.as_dict(), "restart": restarts})
        started = current["started"] if current else time.time()
        if alive and current is not None:
            r.ledger.event(r.run_id, "attempt", f"soak attempt {current['number']} re-attached: its processes "
                           "outlived the controller", stage="soak", rung=rung.name)
        with executor_for(r.cluster, local) as executor:
            status, why = r._launch_and_follow(executor, local, "soak", rung, None, deadline, reattach=alive)
            metrics = r._collect_since(executor, local, attempt, started)
        if why == "deadline":
            r.ledger.finish_attempt(attempt, "passed", _detail(metrics, "soak duration reached"))
            _final_gates(r, rung.name, restarts, metrics)
            return
        if why == "stop requested":
            r.ledger.finish_attempt(attempt, "stopped", _detail(metrics, "stop requested"))
            raise StageFailed("soak stopped on request")
        cause = "; ".join(status.culprits()) or why
        r.ledger.finish_attempt(attempt, "failed", _detail(metrics, cause))
        r.ledger.event(r.run_id, "failure", f"soak run failed: {cause}", stage="soak", rung=rung.name)
        if restarts + 1 > r.config.soak_max_restarts:
            r.ledger.verdict(r.run_id, "soak", rung.name, "no_unrecovered_failure", False, restarts + 1,
                             r.config.soak_max_restarts, f"failed {restarts + 1} times: {cause}")
            raise StageFailed(f"soak: unrecovered failure after {restarts} restart(s): {cause}")
        r.ledger.event(r.run_id, "restart", f"restarting the soak from its last checkpoint ({restarts + 1} of "
                       f"{r.config.soak_max_restarts})", stage="soak", rung=rung.name)


def _alive(r: Rollout, local: Path) -> bool:
    with executor_for(r.cluster, local) as executor:
        return executor.poll().running


def _soak_dir(r: Rollout, rung: Any) -> Path:
    """The soak's one run directory (rendered once; restarts reuse it so checkpoints carry over)."""
    for a in r.ledger.attempts(r.run_id, "soak"):
        return Path(a["detail"]["local_run"])
    local = r.run_dir / "attempts" / "soak-target"
    if not (local / "manifest.json").exists():
        opts = r.render_options("soak", rung, SOAK_ITERATIONS, f"{r.run_id}-soak")
        render_attempt(r.cluster, rung, opts, r.config.layout, local)
    return local


def _detail(metrics: list[dict[str, Any]], why: str) -> dict[str, Any]:
    last = metrics[-1] if metrics else {}
    return {"why": why, "iterations": last.get("iteration"), "final_loss": last.get("loss")}


def _final_gates(r: Rollout, rung: str, restarts: int, metrics: list[dict[str, Any]]) -> None:
    verdicts = [gates.GateVerdict("no_unrecovered_failure", True, restarts, r.config.soak_max_restarts,
                                  f"soak completed its duration with {restarts} restart(s)")]
    all_metrics = [m for m in metrics if m]
    if all_metrics:
        verdicts.append(gates.losses_finite(all_metrics))
    for v in verdicts:
        r.ledger.verdict(r.run_id, "soak", rung, v.gate, v.passed, v.measured, v.threshold, v.reason)
    failed = [v for v in verdicts if not v.passed]
    if failed:
        raise StageFailed(f"soak: gate {failed[0].gate} failed: {failed[0].reason}")
