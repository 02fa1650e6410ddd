"""The attempt service: what every stage does with an attempt of a rung, and the only way a stage reaches the
nodes, the ledger's verdicts and the live view.

    render   a rung's run directory (rollout/attempt.py's rendering)      -> the planner's summary
    executor the executor of a rendered run (a context manager)
    launch   upload and start it, an attempt marker in its logs first     (StageFailed naming a refusing node)
    follow   poll it to its end, the deadline or a stop request           -> (status, why it ended)
    collect  fetch its files; its new metrics lines into the ledger       -> the metrics
    judge    write gate verdicts, each one a gate the stage declared      (UndeclaredGate otherwise)
    record   the verdicts and the attempt's end (passed or failed)        (GateFailed on a failed gate)

and the stage's own bookkeeping, each a named call on the ledger of this rollout (no stage calls the ledger; the soak
still hands it to inject.Injector, which records its firings itself): its attempts (start_attempt, finish_attempt,
attempts), its rungs (add_rungs, rung_states, set_rung), its events (event, events) and when it first started
(stage_started).

The stages (rollout/stages/) are peers over it: warmup, scale and soak each call these and nothing of one
another's. The service knows no stage: it sits below them and above the executors and the ledger."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stepdeploy import noderecords
from stepdeploy.errors import StepdeployError
from stepdeploy.inventory.model import Cluster
from stepdeploy.ledger import Ledger
from stepdeploy.monitor.parse_workload import METRIC_NAMES  # the names the report plots
from stepdeploy.remote.executor import Executor, RunStatus, StopResult
from stepdeploy.render import RenderOptions
from stepdeploy.rollout import gates, recovery
from stepdeploy.rollout.attempt import (
    Live,
    executor_for,
    follow,
    metric_rows,
    metric_time,
    read_metrics,
    read_phases,
    render_attempt,
)
from stepdeploy.rollout.clock import REAL, Clock
from stepdeploy.rollout.config import RolloutConfig, StageFailed, poll_interval
from stepdeploy.rollout.inject import FaultActions
from stepdeploy.rollout.ladder import Rung

Executors = Callable[[Cluster, Path], Executor]  # (cluster, a rendered run's local directory) -> its executor


class UndeclaredGate(AssertionError):
    """A stage recorded a gate its plan does not list: `rollout run --dry-run` would not show what runs."""


class GateFailed(StageFailed):
    """A gate of an attempt failed (its verdict is in the ledger)."""

    def __init__(self, message: str, verdict: gates.GateVerdict) -> None:
        super().__init__(message)
        self.verdict = verdict



# A save in flight when a run is stopped left a staging directory (never committed: a resume discards it). The ranks
# remove their own on SIGTERM; one killed after the stop's grace cannot. Swept only once the stop is proven on every
# node (no process of the run left to write into it), as the soak's recovery does before a restart (issue 36).
SWEEP_STAGING = "rm -rf -- out/checkpoints/.iter_*.tmp*"


def stop_and_sweep(executor: Executor) -> list[StopResult]:
    """Stop the run everywhere; when every node says nothing of it is left, remove its uncommitted staging
    directories (best effort: what stays, the next start's repair removes). -> the stop's results"""
    results = executor.stop()
    if results and all(result.ok for result in results):
        executor.run_command(SWEEP_STAGING)
    return list(results or [])


class AttemptService:
    def __init__(self, run_dir: Path, ledger: Ledger, run_id: str, config: RolloutConfig, cluster: Cluster, *,
                 on_tick: Callable[[Live], None] = lambda _live: None, clock: Clock = REAL,
                 executors: Executors | None = None, faults: FaultActions | None = None) -> None:
        """`clock`: time and sleep (a test's jumps); `executors`: the executor of a rendered run (default: the one
        its manifest names); `faults`: how the soak's link-down and node-loss act (None: on real nodes)."""
        self.run_dir, self.ledger, self.run_id, self.config = run_dir, ledger, run_id, config
        self.cluster, self.on_tick, self.clock, self.faults = cluster, on_tick, clock, faults
        self.live = Live()
        self._executors = executors

    # --- reaching a run -------------------------------------------------------------------------------------
    def executor(self, local: Path) -> Executor:
        """The executor of the run rendered in `local` (a context manager)."""
        return (self._executors or executor_for)(self.cluster, local)

    def stop_requested(self) -> bool:
        return (self.run_dir / "STOP").exists()

    # --- the stage's bookkeeping in the ledger -----------------------------------------------------------------
    def event(self, stage: str, kind: str, message: str, data: dict[str, Any] | None = None, *,
              rung: str | None = None) -> None:
        self.ledger.event(self.run_id, kind, message, stage=stage, rung=rung, data=data)

    def events(self, stage: str, kind: str | None = None) -> list[dict[str, Any]]:
        """The stage's events so far, oldest first (of `kind` only, when given)."""
        return [e for e in self.ledger.events(self.run_id, kind=kind) if e["stage"] == stage]

    def stage_started(self, stage: str) -> float | None:
        """When the stage first started (kept across controllers: a resumed soak goes on with the same clock)."""
        return next((s.started for s in self.ledger.stages(self.run_id) if s.name == stage), None)

    def start_attempt(self, stage: str, rung: str, detail: dict[str, Any]) -> int:
        """A new attempt of the stage's rung, recorded `running` before anything acts; -> its id."""
        return self.ledger.start_attempt(self.run_id, stage, rung, detail)

    def finish_attempt(self, attempt: int, status: str, detail: dict[str, Any]) -> None:
        self.ledger.finish_attempt(attempt, status, detail)

    def attempts(self, stage: str | None, rung: str | None = None) -> list[dict[str, Any]]:
        """The stage's attempts so far (every stage's: None), oldest first (of `rung` only, when given)."""
        return [a for a in self.ledger.attempts(self.run_id, stage) if rung is None or a["rung"] == rung]

    def add_rungs(self, stage: str, rungs: list[Rung]) -> None:
        """The stage's rungs, in order (those already recorded keep their state)."""
        self.ledger.add_rungs(self.run_id, stage, [(rung.name, rung.as_dict()) for rung in rungs])

    def rung_states(self, stage: str) -> dict[str, str]:
        """Each recorded rung of the stage -> its state (pending, running, passed, failed, skipped, stopped)."""
        return {row["name"]: row["status"] for row in self.ledger.rungs(self.run_id, stage)}

    def set_rung(self, stage: str, rung: str, status: str, reason: str | None = None) -> None:
        self.ledger.set_rung(self.run_id, stage, rung, status, reason)

    @contextmanager
    def finishes(self, attempt: int) -> Iterator[None]:
        """An error that ends the block leaves the attempt failed with it, never `running` (a controller killed
        outright leaves it running on purpose: `rollout resume` re-attaches to its processes)."""
        try:
            yield
        except Exception as exc:
            if any(a["id"] == attempt and a["status"] == "running" for a in self.ledger.attempts(self.run_id)):
                why = exc.message if isinstance(exc, StepdeployError) else f"{type(exc).__name__}: {exc}"
                self.finish_attempt(attempt, "failed", {"why": why})
            raise

    # --- render -----------------------------------------------------------------------------------------------
    def render_options(self, stage: str, rung: Rung, iterations: int, run_id: str,
                       schedule: tuple[int, int] | None = None, save_interval: int = 0) -> RenderOptions:
        """`schedule`: (warmup, decay) iterations of the learning rate (the soak's, from its expected length);
        `save_interval`: checkpoint every N iterations (the soak's; 0: only at the end)."""
        warmup, decay = schedule or (None, None)
        return RenderOptions(run_id=run_id, stage=stage, iterations=iterations, nproc_per_node=rung.nproc_per_node,
                             pg_timeout_s=self.config.pg_timeout_s, seq_length=self.config.seq_length,
                             global_batch_size=self.config.global_batch_size, save_interval=save_interval,
                             keep_checkpoints=self.config.keep_checkpoints,
                             executor=self.config.executor,  # None: the inventory's stepdeploy_executor
                             data=self.config.data, warmup_iterations=warmup, decay_iterations=decay,
                             extra_env=self.config.extra_env)

    def render(self, rung: Rung, opts: RenderOptions, local: Path) -> dict[str, Any]:
        """Write the rung's run directory to `local` (the target's with the configured layout, a proxy's with
        the planner's best); returns the planner's summary for its layout."""
        layout = self.config.layout if rung.model == self.config.model else None
        return render_attempt(self.cluster, rung, opts, layout, local)

    # --- launch and follow ------------------------------------------------------------------------------------
    def launch(self, executor: Executor, local: Path, where: str, label: str) -> None:
        """Upload and start the run; an attempt marker goes into the run's logs before the start, so that its
        diagnosis reads its own lines only. A launch refused by a node raises StageFailed naming it (a full
        disk as such)."""
        bad = [r for r in executor.prepare(local) if not r.ok]
        if not bad:
            executor.run_command(recovery.marker_command(label, self.clock.time()))  # best effort: see above
            bad = [r for r in executor.start() if not r.ok]
        if bad:
            raise StageFailed(recovery.launch_failure(executor, where, bad))

    def follow(self, executor: Executor, stage: str, rung: Rung, total: int | None, deadline: float, *,
               check: Callable[[RunStatus], str | None] | None = None) -> tuple[RunStatus, str]:
        """Follow the run on the live view until it ends, `deadline` passes, a stop is requested or `check`
        (seeing every poll) says why to end; a run still running then is stopped, and so is one whose
        following raised (nothing is left running behind an attempt that ends with an error)."""
        self.live = Live(stage=stage, rung=rung.name, total=total, started=self.clock.time(), deadline=deadline)
        try:
            status, why = follow(executor, self.live, deadline=deadline, interval=poll_interval(self.config, executor),
                                 should_stop=self.stop_requested, on_tick=self.on_tick, check=check, clock=self.clock)
        except Exception:
            executor.stop()
            raise
        if status.running:
            stop_and_sweep(executor)
        return status, why

    # --- collect and record -----------------------------------------------------------------------------------
    def collect(self, executor: Executor, local: Path, attempt: int, since: float = 0.0) -> list[dict[str, Any]]:
        """Fetch the run's files; metrics lines written since `since` go to the ledger (a restarted soak
        appends to the same metrics file, so earlier attempts' lines are not counted twice)."""
        fetched = local / "fetched"
        refused = [r for r in executor.fetch(fetched) if not r.ok or "left out" in r.detail]
        tally = noderecords.Tally()
        metrics = [m for m in read_metrics(fetched, tally) if metric_time(m) >= since]
        read_phases(fetched, tally)
        if refused or tally:  # the node's fault, said where the report shows it (a ledger event of its own kind)
            found = [f"{r.node}: {r.detail}" for r in refused] + tally.describe()
            self.ledger.event(self.run_id, "node_data", "what the nodes sent was not all read: " + "; ".join(found),
                              data={"attempt": attempt, "fetch": [asdict(r) for r in refused], "bad": tally.bad,
                                    "warnings": tally.warnings})
        if metrics:
            self.ledger.add_metrics(self.run_id, attempt, metric_rows(metrics, METRIC_NAMES))
        return metrics

    def judge(self, stage: str, rung: str, verdicts: list[gates.GateVerdict], declared: Collection[str]) -> None:
        """Write the verdicts; each must be a gate the stage's plan declares (`declared`: what `rollout run
        --dry-run` lists for it), else UndeclaredGate before anything is written."""
        undeclared = [v.gate for v in verdicts if v.gate not in declared]
        if undeclared:
            raise UndeclaredGate(f"{stage}/{rung}: gate(s) {', '.join(undeclared)} not in the stage's plan "
                                 f"({', '.join(declared)})")
        for v in verdicts:
            self.ledger.verdict(self.run_id, stage, rung, v.gate, v.passed, v.measured, v.threshold, v.reason)

    def record(self, stage: str, rung: Rung, attempt: int, verdicts: list[gates.GateVerdict],
               metrics: list[dict[str, Any]], declared: Collection[str]) -> None:
        """The verdicts, then the attempt's end: passed, or failed with GateFailed naming the first failed gate."""
        self.judge(stage, rung.name, verdicts, declared)
        failed = [v for v in verdicts if not v.passed]
        last = metrics[-1] if metrics else {}
        self.finish_attempt(attempt, "failed" if failed else "passed",
                            {"iterations": last.get("iteration"), "final_loss": last.get("loss"),
                             "tokens_per_gpu": gates.throughput_per_gpu(metrics, rung.world)})
        if failed:
            raise GateFailed(f"{stage}/{rung.name}: gate {failed[0].gate} failed: {failed[0].reason}", failed[0])
