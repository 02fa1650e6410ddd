"""One gated attempt of a rung, run to its end: what warmup and scale share (the soak restarts instead).

The attempt is one a dead controller left running (re-attached if its processes live, else recorded failed) or a
new one rendered into its own directory; what its layout needs beyond the stock stack is verified on its nodes
(stages/needs.py), it is launched, followed to its end, collected, and judged by GATES
(it completed, its losses are finite) and, when it completed, by the stage's own gates."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stepdeploy.errors import BadInput
from stepdeploy.monitor import diagnose
from stepdeploy.render.manifest import Manifest
from stepdeploy.rollout import gates, recovery
from stepdeploy.rollout.config import StageStopped
from stepdeploy.rollout.ladder import Rung
from stepdeploy.rollout.service import AttemptService
from stepdeploy.rollout.stages import needs

GATES = ("completed", "loss_finite")  # every gated attempt's, before the stage's own
Metrics = list[dict[str, Any]]
Judge = Callable[[Metrics, dict[str, Any]], list[gates.GateVerdict]]  # (metrics, the planner's summary) -> verdicts


def gated_attempt(service: AttemptService, stage: str, rung: Rung, iterations: int, declared: Sequence[str],
                  judge: Judge | None = None) -> Metrics:
    """Run the attempt and record its verdicts (`declared`: the gate names the stage's plan lists for the rung);
    returns its metrics. GateFailed on a failed gate, StageStopped on a stop request, StageFailed on a launch
    a node refused."""
    attempt, local, summary, reattach = _attempt_for(service, stage, rung, iterations)
    label = f"{stage}/{rung.name} attempt {attempt}"
    with service.finishes(attempt), service.executor(local) as executor:
        if not reattach:
            needs.verify(service, executor, Manifest.load(local), stage, rung.name)
            service.launch(executor, local, f"{stage}/{rung.name}", label)
        status, why = service.follow(executor, stage, rung, iterations,
                                     service.clock.time() + service.config.attempt_timeout_s)
        metrics = service.collect(executor, local, attempt)
        if why == "stop requested":
            service.finish_attempt(attempt, "stopped", {"why": "stop requested"})
            raise StageStopped(f"{stage}/{rung.name}: stopped on request")
        ok = status.finished_ok and why == "exited"
        culprits = status.culprits() or [why]
        if not ok:  # a known signature in the logs says why, first
            lines = recovery.attempt_log_lines(executor, [t.name for t in executor.targets])
            culprits = [f"{d.signature}: {d.cause}" for d in diagnose.diagnose("\n".join(lines))] + culprits
    verdicts = [gates.completed(ok, culprits), gates.losses_finite(metrics)]
    if judge is not None and ok:
        verdicts += judge(metrics, summary)
    service.record(stage, rung, attempt, verdicts, metrics, declared)
    return metrics


def _attempt_for(service: AttemptService, stage: str, rung: Rung, iterations: int
                 ) -> tuple[int, Path, dict[str, Any], bool]:
    """(attempt id, its run directory, the planner's summary, whether it is re-attached)."""
    mine = service.attempts(stage, rung.name)
    if mine and mine[-1]["status"] == "running":
        left = mine[-1]
        local = Path(str(left["detail"].get("local_run") or service.run_dir / "attempts" / "missing"))
        try:
            with service.executor(local) as executor:
                status = executor.poll()
        except BadInput as exc:  # its run directory is gone or damaged: nothing to re-attach to
            service.finish_attempt(left["id"], "failed", {"reason": f"cannot re-attach: {exc.message}"})
            return _new_attempt(service, stage, rung, iterations, len(mine) + 1)
        if status.running or status.finished_ok:
            service.event(stage, "attempt", f"{stage}/{rung.name} attempt {left['number']} re-attached",
                          rung=rung.name)
            return left["id"], local, left["detail"].get("plan", {}), True
        service.finish_attempt(left["id"], "failed", {"reason": "the controller died and so did the run: "
                                                      + "; ".join(status.culprits() or ["processes gone"])})
    return _new_attempt(service, stage, rung, iterations, len(mine) + 1)


def _new_attempt(service: AttemptService, stage: str, rung: Rung, iterations: int, number: int
                 ) -> tuple[int, Path, dict[str, Any], bool]:
    local = service.run_dir / "attempts" / f"{stage}-{rung.name}-a{number}"
    opts = service.render_options(stage, rung, iterations, f"{service.run_id}-{stage}-{rung.name}-a{number}")
    summary = service.render(rung, opts, local)
    attempt = service.start_attempt(stage, rung.name,
                                    {"local_run": str(local), "rung": rung.as_dict(), "plan": summary})
    return attempt, local, summary, False
