"""The rollout controller: stages in order, each gated; every transition written to the ledger before it is
acted on, so `rollout resume` continues after any crash of the controller (kill -9 included).

Every attempt ends in a final state: passed, failed (a gate, a failed run, or any error on the way: a launch
refused by a node, an unreachable node, a full disk), or stopped (`rollout stop`). A stop ends the stage and
the run `stopped` (StageStopped), never `failed`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stepdeploy.errors import BadInput, StepdeployError
from stepdeploy.inventory import load_cluster
from stepdeploy.inventory.model import Cluster
from stepdeploy.ledger import Ledger, NotALedger
from stepdeploy.monitor import diagnose
from stepdeploy.monitor.parse_workload import METRIC_NAMES  # the names the report plots
from stepdeploy.remote.executor import Executor
from stepdeploy.render import RenderOptions
from stepdeploy.rollout import gates, recovery, soak
from stepdeploy.rollout.attempt import (
    Live,
    executor_for,
    follow,
    metric_rows,
    metric_time,
    read_metrics,
    render_attempt,
)
from stepdeploy.rollout.clock import REAL, Clock
from stepdeploy.rollout.config import RolloutConfig, StageFailed, StageStopped
from stepdeploy.rollout.inject import FaultActions
from stepdeploy.rollout.ladder import STAGES, Rung, scale_ladder, target_rung


class Rollout:
    def __init__(self, run_dir: Path, ledger: Ledger, run_id: str, config: RolloutConfig,
                 on_tick: Callable[[Live], None] = lambda _live: None, cluster: Cluster | None = None, *,
                 clock: Clock = REAL, executors: Callable[[Cluster, Path], Any] | None = None,
                 faults: FaultActions | None = None) -> None:
        """`cluster`: the inventory as the CLI accepted it (host-key checking); None: read config.inventory.
        `clock`: time and sleep (a test's jumps); `executors`: (cluster, local run directory) -> the executor of
        that run (default: the one its manifest names); `faults`: how the soak's link-down and node-loss act
        (default: on real nodes; the CLI passes the simulated cluster's)."""
        self.run_dir, self.ledger, self.run_id, self.config = run_dir, ledger, run_id, config
        self.cluster: Cluster = cluster or load_cluster(config.inventory)
        self.on_tick = on_tick
        self.live = Live()
        self.clock, self.faults = clock, faults
        self._executors = executors

    def executor_for(self, local: Path) -> Executor:
        """The executor of the run rendered in `local` (a context manager)."""
        return (self._executors or executor_for)(self.cluster, local)

    # --- the whole run -------------------------------------------------------------------------------------
    def run(self) -> None:
        unknown = [s.name for s in self.ledger.stages(self.run_id) if s.name not in STAGES]
        if unknown:  # before anything is written
            raise NotALedger(f"{self.ledger.path}: stage {unknown[0]!r} is not a rollout stage "
                             f"({', '.join(STAGES)}); not a ledger this stepdeploy wrote")
        self.ledger.set_run_status(self.run_id, "running")
        while (stage := self.ledger.next_stage(self.run_id)) is not None:
            if self.stop_requested():
                self.ledger.set_stage(self.run_id, stage.name, "stopped", "stop requested")
                self.ledger.set_run_status(self.run_id, "stopped")
                return
            self.ledger.set_stage(self.run_id, stage.name, "running")
            try:
                try:
                    getattr(self, f"_{stage.name}")()
                except BadInput as exc:  # met once the rollout runs (a rendering refused): the stage fails
                    raise StageFailed(f"{stage.name}: {exc.message}", hint=exc.hint) from None
            except StageStopped as exc:
                self.ledger.set_stage(self.run_id, stage.name, "stopped", exc.message)
                self.ledger.set_run_status(self.run_id, "stopped")
                raise
            except StageFailed as exc:
                self.ledger.set_stage(self.run_id, stage.name, "failed", exc.message)
                self.ledger.set_run_status(self.run_id, "failed")
                raise
            self.ledger.set_stage(self.run_id, stage.name, "passed")
        self.ledger.set_run_status(self.run_id, "passed")

    def stop_requested(self) -> bool:
        return (self.run_dir / "STOP").exists()

    @contextmanager
    def finishes(self, attempt: int) -> Iterator[None]:
        """An error that ends the block leaves the attempt failed with it, never `running` (a controller killed
        outright leaves it running on purpose: `rollout resume` re-attaches to its processes)."""
        try:
            yield
        except Exception as exc:
            if any(a["id"] == attempt and a["status"] == "running" for a in self.ledger.attempts(self.run_id)):
                why = exc.message if isinstance(exc, StepdeployError) else f"{type(exc).__name__}: {exc}"
                self.ledger.finish_attempt(attempt, "failed", {"why": why})
            raise

    # --- stages ----------------------------------------------------------------------------------------------
    def _warmup(self) -> None:
        rung = target_rung(self.cluster, self.config.model)
        metrics, _summary, _status = self._gated_attempt("warmup", rung, self.config.warmup_iterations)
        first, steady = gates.steady_step_time(metrics)
        self.ledger.event(self.run_id, "warmup", f"first step {first} s, steady step {steady} s", stage="warmup",
                          data={"first_step_s": first, "steady_step_s": steady})

    def _scale(self) -> None:
        rungs = scale_ladder(self.cluster, self.config.model, self.config.proxy_model)
        self.ledger.add_rungs(self.run_id, "scale", [(r.name, r.as_dict()) for r in rungs])
        done = {r["name"]: r for r in self.ledger.rungs(self.run_id, "scale")}
        previous: tuple[str, float | None] | None = None  # the last rung run: (its model, per-GPU throughput)
        for rung in rungs:
            if done[rung.name]["status"] == "passed":
                previous = (rung.model, self._recorded_throughput(rung.name))
                continue
            if rung.skip_reason:
                self.ledger.set_rung(self.run_id, "scale", rung.name, "skipped", rung.skip_reason)
                continue
            self.ledger.set_rung(self.run_id, "scale", rung.name, "running")
            metrics, _summary, _status = self._gated_attempt(
                "scale", rung, self.config.scale_iterations,
                extra=lambda m, s, r=rung, p=previous: self._scale_gates(r, m, s, p))
            previous = (rung.model, gates.throughput_per_gpu(metrics, rung.world))
            self.ledger.set_rung(self.run_id, "scale", rung.name, "passed")

    def _scale_gates(self, rung: Rung, metrics: list[dict[str, Any]], summary: dict[str, Any],
                     previous: tuple[str, float | None] | None) -> list[gates.GateVerdict]:
        """Scaling efficiency only against the previous rung of the same model; a rung that changes the model
        (the target after its proxy) is judged by its MFU against the plan."""
        t = self.config.thresholds
        current = gates.throughput_per_gpu(metrics, rung.world)
        peak = max((m["mem_peak_gib"] for m in metrics if m.get("mem_peak_gib")), default=None)
        if previous is not None and previous[0] != rung.model:
            scaling = gates.mfu_matches_plan(gates.steady_mfu(metrics), summary.get("predicted_mfu"), t)
        else:
            scaling = gates.scaling_efficiency(current, previous[1] if previous else None, t)
        verdicts = [gates.loss_falling(metrics, t), scaling,
                    gates.memory_matches_plan(peak, summary.get("predicted_torch_allocated_gib"), t)]
        ceiling = gates.step_time_ceiling(metrics, t)
        return [*verdicts, ceiling] if ceiling else verdicts

    def _recorded_throughput(self, rung: str) -> float | None:
        attempts = self.ledger.attempts(self.run_id, "scale")
        passed = [a for a in attempts if a["rung"] == rung and a["status"] == "passed"]
        return passed[-1]["detail"].get("tokens_per_gpu") if passed else None

    def _soak(self) -> None:
        soak.run_soak(self)

    # --- one gated attempt -----------------------------------------------------------------------------------
    def _gated_attempt(self, stage: str, rung: Rung, iterations: int,
                       extra: Callable[[list[dict[str, Any]], dict[str, Any]], list[gates.GateVerdict]] | None = None,
                       ) -> tuple[list[dict[str, Any]], dict[str, Any], Any]:
        attempt, local, summary, reattach = self._attempt_for(stage, rung, iterations)
        with self.finishes(attempt), self.executor_for(local) as executor:
            status, why = self.launch_and_follow(executor, local, stage, rung, iterations,
                                                 self.clock.time() + self.config.attempt_timeout_s, reattach=reattach,
                                                 label=f"{stage}/{rung.name} attempt {attempt}")
            metrics = self._collect(executor, local, attempt)
            if why == "stop requested":
                self.ledger.finish_attempt(attempt, "stopped", {"why": "stop requested"})
                if stage == "scale":
                    self.ledger.set_rung(self.run_id, stage, rung.name, "stopped", "stop requested")
                raise StageStopped(f"{stage}/{rung.name}: stopped on request")
            culprits = status.culprits() or [why]
            if not (status.finished_ok and why == "exited"):  # a known signature in the logs says why, first
                culprits = [f"{d.signature}: {d.cause}" for d in diagnose.diagnose("\n".join(
                    recovery.attempt_log_lines(executor, [t.name for t in executor.targets])))] + culprits
        verdicts = [gates.completed(status.finished_ok and why == "exited", culprits), gates.losses_finite(metrics)]
        if extra is not None and verdicts[0].passed:
            verdicts += extra(metrics, summary)
        self._record(stage, rung, attempt, verdicts, metrics)
        return metrics, summary, status

    def _attempt_for(self, stage: str, rung: Rung, iterations: int) -> tuple[int, Path, dict[str, Any], bool]:
        """The attempt to follow: one a dead controller left running (re-attached if its processes live,
        else recorded as failed), or a new one, rendered into its own directory."""
        mine = [a for a in self.ledger.attempts(self.run_id, stage) if a["rung"] == rung.name]
        if mine and mine[-1]["status"] == "running":
            left = mine[-1]
            local = Path(str(left["detail"].get("local_run") or self.run_dir / "attempts" / "missing"))
            try:
                with self.executor_for(local) as executor:
                    status = executor.poll()
            except BadInput as exc:  # its run directory is gone or damaged: nothing to re-attach to
                self.ledger.finish_attempt(left["id"], "failed", {"reason": f"cannot re-attach: {exc.message}"})
                return self._new_attempt(stage, rung, iterations, len(mine) + 1)
            if status.running or status.finished_ok:
                self.ledger.event(self.run_id, "attempt", f"{stage}/{rung.name} attempt {left['number']} "
                                  "re-attached", stage=stage, rung=rung.name)
                return left["id"], local, left["detail"].get("plan", {}), True
            self.ledger.finish_attempt(left["id"], "failed", {"reason": "the controller died and so did the run: "
                                                              + "; ".join(status.culprits() or ["processes gone"])})
        return self._new_attempt(stage, rung, iterations, len(mine) + 1)

    def _new_attempt(self, stage: str, rung: Rung, iterations: int, number: int
                     ) -> tuple[int, Path, dict[str, Any], bool]:
        local = self.run_dir / "attempts" / f"{stage}-{rung.name}-a{number}"
        opts = self.render_options(stage, rung, iterations, f"{self.run_id}-{stage}-{rung.name}-a{number}")
        layout = self.config.layout if rung.model == self.config.model else None
        summary = render_attempt(self.cluster, rung, opts, layout, local)
        attempt = self.ledger.start_attempt(self.run_id, stage, rung.name,
                                            {"local_run": str(local), "rung": rung.as_dict(), "plan": summary})
        return attempt, local, summary, False

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
                             data=self.config.data, warmup_iterations=warmup, decay_iterations=decay)

    def launch_and_follow(self, executor: Executor, local: Path, stage: str, rung: Rung, total: int | None,
                          deadline: float, *, reattach: bool = False, check: Callable[[Any], str | None] | None = None,
                          label: str = "") -> tuple[Any, str]:
        """Upload and start the run (unless re-attaching), then follow it; an attempt marker goes into the
        run's logs before the start, so that its diagnosis reads its own lines only. A launch refused by a node
        raises StageFailed naming it (a full disk as such); an error while following stops the run first."""
        if not reattach:
            self._launch(executor, local, f"{stage}/{rung.name}", label or f"{stage}/{rung.name}")
        self.live = Live(stage=stage, rung=rung.name, total=total, started=self.clock.time(), deadline=deadline)
        try:
            status, why = follow(executor, self.live, deadline=deadline, interval=self.config.poll_interval_s,
                                 should_stop=self.stop_requested, on_tick=self.on_tick, check=check, clock=self.clock)
        except Exception:
            executor.stop()  # nothing is left running behind an attempt that ends with an error
            raise
        if status.running:
            executor.stop()
        return status, why

    def _launch(self, executor: Any, local: Path, where: str, label: str) -> None:
        bad = [r for r in executor.prepare(local) if not r.ok]
        if not bad:
            executor.run_command(recovery.marker_command(label, self.clock.time()))  # best effort: see above
            bad = [r for r in executor.start() if not r.ok]
        if bad:
            raise StageFailed(recovery.launch_failure(executor, where, bad))

    def _collect(self, executor: Executor, local: Path, attempt: int) -> list[dict[str, Any]]:
        return self.collect_since(executor, local, attempt, 0.0)

    def collect_since(self, executor: Executor, local: Path, attempt: int, since: float
                      ) -> list[dict[str, Any]]:
        """Fetch the run's files; metrics lines written since `since` go to the ledger (a restarted soak
        appends to the same metrics file, so earlier attempts' lines are not counted twice)."""
        fetched = local / "fetched"
        executor.fetch(fetched)
        metrics = [m for m in read_metrics(fetched) if metric_time(m) >= since]
        if metrics:
            self.ledger.add_metrics(self.run_id, attempt, metric_rows(metrics, METRIC_NAMES))
        return metrics

    def _record(self, stage: str, rung: Rung, attempt: int, verdicts: list[gates.GateVerdict],
                metrics: list[dict[str, Any]]) -> None:
        for v in verdicts:
            self.ledger.verdict(self.run_id, stage, rung.name, v.gate, v.passed, v.measured, v.threshold, v.reason)
        failed = [v for v in verdicts if not v.passed]
        last = metrics[-1] if metrics else {}
        self.ledger.finish_attempt(attempt, "failed" if failed else "passed",
                                   {"iterations": last.get("iteration"), "final_loss": last.get("loss"),
                                    "tokens_per_gpu": gates.throughput_per_gpu(metrics, rung.world)})
        if failed:
            if stage == "scale":
                self.ledger.set_rung(self.run_id, stage, rung.name, "failed", failed[0].reason)
            raise StageFailed(f"{stage}/{rung.name}: gate {failed[0].gate} failed: {failed[0].reason}")
