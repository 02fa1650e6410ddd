"""The soak stage: the target configuration for a duration, checkpointing periodically, watched by the
monitors (rollout/monitors.py) and, on request, hit by injected faults (rollout/inject.py).

A failure is detected while the run is in flight (a rank died, a heartbeat went stale, a node became
unreachable, a link went down) or when it ends, classified (crash | hang | link | node-loss), and recovered:
every process of the run stopped on every node and shown to be gone, a lost node waited for, the failed
ranks' logs diagnosed, the run restarted from its last complete checkpoint (the same run directory: the
workload resumes from `latest`) up to `soak_max_restarts`; restarts without progress stop the soak early.
Every step is a ledger event, recorded through the attempt service (rollout/service.py) as the other stages record
theirs. The soak clock is the stage's first start in the ledger, so a resumed controller continues the same soak
(and does not fire an injection twice). Time is read from the service's clock (rollout/clock.py) and the nodes are
reached through its executors, so the state machine runs against stepdeploy.testing's scripted executor in a unit
test. What the warm-up measured (its step time and start-up) reaches the soak typed (stages/measured.py).

A stop requested while the soak restarts (`rollout stop` between a failure and the next launch, or while a
lost node is waited for) launches nothing more: the stage ends `stopped`, as a stop during a run does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdeploy.catalog import load_model
from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Cluster
from stepdeploy.monitor import classify, diagnose
from stepdeploy.monitor.classify import Classification
from stepdeploy.monitor.model import MonitorLimits
from stepdeploy.remote.executor import Executor, RunStatus
from stepdeploy.render.manifest import Manifest
from stepdeploy.render.workload_file import Workload
from stepdeploy.rollout import checkpoint_interval, gates, goodput, inject, monitors, training_gates
from stepdeploy.rollout.attempt import read_metrics, read_phases
from stepdeploy.rollout.config import AUTO, RolloutConfig, StageFailed, StageStopped
from stepdeploy.rollout.ladder import Rung, target_rung
from stepdeploy.rollout.service import AttemptService
from stepdeploy.rollout.stages import needs
from stepdeploy.rollout.stages.measured import TargetStep
from stepdeploy.rollout.stages.soak_recovery import CLEAR_RANK_FILES, NAME, recover
from stepdeploy.rollout.stages.soak_schedule import (  # noqa: F401  (FIXED_SOURCE, MAX_WARMUP: re-exported)
    FIXED_SOURCE,
    MAX_WARMUP,
    SoakSchedule,
    soak_schedule,
)

SOAK_ITERATIONS = 10**9  # the soak ends by time, not by count (unless --soak-iterations gives one)


@dataclass
class Watch:
    """What the follow loop runs on every poll: injections, the monitors, the failure decision."""

    service: AttemptService
    monitor: monitors.SoakMonitor
    injector: inject.Injector | None
    live_goodput: goodput.LiveGoodput
    verdict: Classification | None = None
    detected_at: float | None = None

    def check(self, status: RunStatus) -> str | None:
        service = self.service
        now = service.clock.time()
        self.live_goodput.observe(service.live.last)
        service.live.goodput = self.live_goodput.ratio(now)
        if self.injector is not None:
            for line in self.injector.tick(status, now):
                service.live.note(line)
        self.monitor.maybe_collect(status, now)
        verdict = monitors.decide(status, monitors.fail_findings(self.monitor.findings),
                                  service.config.heartbeat_timeout_s, self.monitor.proc_states())
        if verdict is None:
            return None
        now = service.clock.time()  # the injection or the monitor round above may have taken a while
        self.verdict, self.detected_at = verdict, now
        service.event(NAME, "detected", f"{verdict.kind} detected on {verdict.node or 'the network'}"
                      + (f" (rank {verdict.rank})" if verdict.rank is not None else "") + f": {verdict.evidence[0]}",
                      {**verdict.to_json(), "time": now, "iteration": monitors.progress_iteration(status)})
        return f"failure: {verdict.kind}"


FAILURE_GATES = ("no_unrecovered_failure", "progress")  # judged (failed) when restarts run out or stall


def soak_gates(model: str) -> list[str]:
    """The gates a soak that ran its duration is judged by (`loss_finite` and the training gates when it reported
    metrics; the MoE gates when the model has experts and reports their load)."""
    moe = load_model(model).moe
    names = training_gates.gate_names(moe is not None, bool(moe and moe.load_balancing == "expert_bias"))
    return ["no_unrecovered_failure", "loss_finite", *names]


# proxy-0.7b-moe on an H200 (docs/benchmarks.md, calls AJ, AM, AN): a fresh MoE model's routers collapse in its first
# steps and come back under the expert_load gate as the loss leaves the unigram plateau, by steps 40-80; its soak of
# 39 iterations failed the gate (the median after the warm-up), soaks of 255-260 passed it
MOE_SETTLE_ITERATIONS = 200


def expert_load_room(model: str, expected: int) -> str | None:
    """A warning when an MoE soak's expected iterations leave the expert_load gate too little room (None: enough,
    or no such gate)."""
    if "expert_load" not in soak_gates(model) or expected >= MOE_SETTLE_ITERATIONS:
        return None
    return (f"the soak's ~{expected:,} iterations may end before a fresh MoE model's routers recover from their "
            "start-up collapse (proxy-0.7b-moe on an H200: by steps 40-80), and expert_load judges the median after "
            f"the warm-up: a soak of {MOE_SETTLE_ITERATIONS}+ iterations gives it room")


class Soak:
    name = NAME

    def run(self, service: AttemptService) -> None:
        """The soak; its goodput is recorded when it ends, passed, failed or stopped."""
        rung = target_rung(service.cluster, service.config.model)
        soak_started = service.stage_started(self.name) or service.clock.time()
        local = _soak_dir(service, rung)
        try:
            _soak(service, rung, local, soak_started)
        except StageFailed:  # stopped or failed (a controller killed outright records nothing: it resumes)
            _record_goodput(service, local, soak_started)
            raise
        _record_goodput(service, local, soak_started)

    def plan(self, config: RolloutConfig, cluster: Cluster) -> dict[str, Any]:
        plan = {**target_rung(cluster, config.model).as_dict(), "duration_s": config.soak_duration_s,
                "iterations": config.soak_iterations,
                "checkpoint_interval": config.checkpoint_interval, "max_restarts": config.soak_max_restarts,
                "keep_checkpoints": config.keep_checkpoints, "heartbeat_timeout_s": config.heartbeat_timeout_s,
                "monitor_interval_s": config.monitor_interval_s, "gates": soak_gates(config.model),
                "inject": [i.to_json() for i in inject.parse_all(config.inject)],
                "gates_on_failure": list(FAILURE_GATES), "max_stalled_restarts": config.soak_max_stalled_restarts}
        if config.checkpoint_interval == AUTO:
            plan |= _auto_interval(cluster, config)
        if "expert_load" in plan["gates"]:
            step_s, _ = checkpoint_interval.planned_step(cluster, config)
            plan["expert_load_warning"] = expert_load_room(
                config.model, soak_schedule(config.soak_duration_s, step_s, "", iterations=config.soak_iterations
                                            ).expected)
        return plan


def _declared(service: AttemptService) -> list[str]:
    return [*soak_gates(service.config.model), *FAILURE_GATES]


def _auto_interval(cluster: Cluster, config: RolloutConfig) -> dict[str, Any]:
    """The interval `auto` gives before anything is measured; the soak resolves it again when it starts."""
    interval = checkpoint_interval.for_dry_run(cluster, config)
    expected = soak_schedule(config.soak_duration_s, interval.step_s, interval.step_source,
                             iterations=config.soak_iterations).expected
    return {"checkpoint_interval": interval.iterations,
            "checkpoint_interval_auto": {**interval.to_json(), "describe": interval.describe(),
                                         "warning": checkpoint_interval.longer_than_the_soak(interval, expected),
                                         "note": "resolved again when the soak starts, from the save stall and step "
                                                 "time the warm-up and scale stages measured"}}


def _soak(service: AttemptService, rung: Rung, local: Path, soak_started: float) -> None:
    config = service.config
    deadline = soak_started + config.soak_duration_s
    injections = inject.parse_all(config.inject)
    _check_injections(injections, Manifest.load(local).node_names, rung.world)
    while True:
        attempts = service.attempts(NAME)
        restarts = len(spent_restarts(attempts, _launched(service)))
        current = attempts[-1] if attempts and attempts[-1]["status"] == "running" else None
        alive = current is not None and _alive(service, local)
        if current is not None and not alive:  # it died while no controller watched: a failure, restart it
            service.finish_attempt(current["id"], "failed", {"why": "processes gone while no controller ran"})
            continue
        if current is None and service.stop_requested():  # between a failure and its restart: launch nothing more
            raise StageStopped("soak: stopped on request" + (" before its restart" if restarts else ""))
        attempt = current["id"] if current else service.start_attempt(
            NAME, rung.name, {"local_run": str(local), "rung": rung.as_dict(), "restart": restarts,
                              LAUNCH_MARKED: True})
        if alive and current is not None:
            service.event(NAME, "attempt",
                          f"soak attempt {current['number']} re-attached: its processes outlived the controller")
        with service.finishes(attempt):
            cause = _one_attempt(service, rung, local, attempt, current["started"] if current else service.clock.time(),
                                 (alive, restarts), (injections, soak_started, deadline))
            if cause is None:
                return
        _check_limits(service, rung.name, restarts, cause)
        if service.stop_requested():  # `rollout stop` during the recovery: no restart
            raise StageStopped("soak: stopped on request before its restart")
        service.event(NAME, "restart", f"restarting the soak from its last checkpoint ({restarts + 1} of "
                      f"{config.soak_max_restarts})", {"restart": restarts + 1, "time": service.clock.time()})


def _one_attempt(service: AttemptService, rung: Rung, local: Path, attempt: int, started: float,
                 state: tuple[bool, int], plan: tuple[list[inject.Injection], float, float]) -> str | None:
    """Launch (or re-attach to) the attempt and follow it to its end: None when the soak passed its duration,
    else the failure's cause (the attempt recorded failed, the run stopped everywhere and diagnosed)."""
    (alive, restarts), (injections, soak_started, deadline) = state, plan
    config = service.config
    with service.executor(local) as executor:
        if not alive and restarts:  # also after a controller that died mid-recovery (best effort: see recover)
            executor.run_command(CLEAR_RANK_FILES)
        watch = _watch(service, executor, local, injections, soak_started)
        if not alive:
            needs.verify(service, executor, Manifest.load(local), NAME, rung.name)
            service.launch(executor, local, f"soak/{rung.name}", f"soak attempt {attempt}")
            service.event(NAME, "launched", f"soak attempt {attempt} launched", {"attempt": attempt})
        status, why = service.follow(executor, NAME, rung, config.soak_iterations, deadline, check=watch.check)
        metrics = service.collect(executor, local, attempt, started)
        trained = why == "exited" and status.finished_ok and config.soak_iterations is not None
        if why == "deadline" or trained:
            done = f"{config.soak_iterations:,} iterations trained" if trained else "soak duration reached"
            service.finish_attempt(attempt, "passed", _detail(metrics, done))
            _final_gates(service, rung.name, restarts, local)
            return None
        if why == "stop requested":
            service.finish_attempt(attempt, "stopped", _detail(metrics, "stop requested"))
            raise StageStopped("soak: stopped on request")
        verdict = watch.verdict or classify.classify(status, monitors.fail_findings(watch.monitor.findings),
                                                     config.heartbeat_timeout_s)
        cause = _cause(verdict, status, why)
        if watch.verdict is None:
            service.event(NAME, "detected", f"run ended: {cause}", {**(verdict.to_json() if verdict else {}),
                                                                   "time": service.clock.time()})
        iteration = monitors.progress_iteration(status)
        kind = verdict.kind if verdict else None
        service.finish_attempt(attempt, "failed", {**_detail(metrics, cause), "kind": kind,
                                                   "failed_at_iteration": iteration})
        service.event(NAME, "failure", f"soak run failed: {cause}", {"kind": kind, "iteration": iteration})
        found = recover(service, executor, watch.monitor, verdict)
    full = next((d for d in found if d.signature == diagnose.DISK_FULL), None)
    if full is not None:  # a restart would meet the same full disk (and fail in its upload): say so, once
        where = f" on {verdict.node}" if verdict and verdict.node else ""
        raise StageFailed(f"soak: no space left on device{where}: {full.evidence.split(' | ', 1)[-1]}", hint=full.fix)
    return cause


def _check_injections(injections: list[inject.Injection], nodes: list[str], world: int) -> None:
    """Every injection names a rank or node of this run (`nodes`: its manifest's), before anything starts."""
    for inj in injections:
        try:
            _ = inject.resolve_rank(inj, world) if inj.kind in inject.RANK_KINDS else inject.resolve_node(inj, nodes)
        except BadInput as exc:
            raise StageFailed(f"soak: {exc.message}") from None


def _watch(service: AttemptService, executor: Executor, local: Path, injections: list[inject.Injection],
           soak_started: float) -> Watch:
    config = service.config
    manifest = Manifest.load(local)
    first = service.cluster.node(executor.targets[0].name)
    monitor = monitors.SoakMonitor(executor, monitors.probe_spec(manifest, first.train_iface),
                                   service.run_dir / "monitor" / "stepdeploy.prom",
                                   MonitorLimits(heartbeat_timeout_s=config.heartbeat_timeout_s),
                                   lambda kind, msg, data: service.event(NAME, kind, msg, data),
                                   config.monitor_interval_s)
    fired = {e["data"].get("spec") for e in service.events(NAME, kind="inject")}
    injector = inject.Injector(injections, record=lambda msg, data: service.event(NAME, "inject", msg, data),
                               fired=fired, cluster=service.cluster, executor=executor, started=soak_started,
                               faults=service.faults) if injections else None
    # the live ratio starts from the lines the earlier attempts' collection fetched (local files, no new fetch)
    return Watch(service, monitor, injector, goodput.LiveGoodput(soak_started, read_metrics(local / "fetched")))


def _cause(verdict: Classification | None, status: RunStatus, why: str) -> str:
    if verdict is None:
        return "; ".join(status.culprits()) or why
    where = f" on {verdict.node}" if verdict.node else ""
    rank = f" rank {verdict.rank}" if verdict.rank is not None else ""
    return f"{verdict.kind}{where}{rank}: {verdict.evidence[0]}"


def _check_limits(service: AttemptService, rung: str, restarts: int, cause: str) -> None:
    config = service.config
    if restarts + 1 > config.soak_max_restarts:
        failed = f"failed {restarts + 1} times: {cause}"
        service.judge(NAME, rung, [gates.GateVerdict("no_unrecovered_failure", False, restarts + 1,
                                                     config.soak_max_restarts, failed)], _declared(service))
        raise StageFailed(f"soak: unrecovered failure after {restarts} restart(s): {cause}")
    stalled = stalled_restarts([a["detail"].get("failed_at_iteration")
                                for a in spent_restarts(service.attempts(NAME), _launched(service))])
    if stalled >= config.soak_max_stalled_restarts:
        service.judge(NAME, rung, [gates.GateVerdict("progress", False, stalled, config.soak_max_stalled_restarts,
                                                     f"{stalled} restart(s) in a row without progress: {cause}")],
                      _declared(service))
        raise StageFailed(f"soak: {stalled} restart(s) in a row made no progress: {cause}")


LAUNCH_MARKED = "launch_event"  # an attempt's detail: its launch is recorded as a `launched` event (issue 36)


def spent_restarts(attempts: list[dict[str, Any]], launched: set[int]) -> list[dict[str, Any]]:
    """The failed attempts that spend a restart: those that launched (`launched`: the ids of the `launched`
    events). One whose launch failed, or whose controller died before it launched, spends none; an attempt of a
    ledger written before launches were recorded (no LAUNCH_MARKED in its detail) counts when it failed, as then."""
    return [a for a in attempts if a["status"] == "failed"
            and (a["id"] in launched or not a["detail"].get(LAUNCH_MARKED))]


def _launched(service: AttemptService) -> set[int]:
    return {a for e in service.events(NAME, kind="launched") if type(a := e["data"].get("attempt")) is int}


def stalled_restarts(failed_at: list[int | None]) -> int:
    """How many of the latest failures in a row reached no further than the failure before them."""
    count, best = 0, None
    for it in failed_at:
        progressed = it is not None and (best is None or it > best)
        count = 0 if progressed else count + 1
        best = it if progressed else best
    return count


def _alive(service: AttemptService, local: Path) -> bool:
    with service.executor(local) as executor:
        return executor.poll().running


def _soak_dir(service: AttemptService, rung: Rung) -> Path:
    """The soak's one run directory (rendered once; restarts reuse it so checkpoints carry over)."""
    for a in service.attempts(NAME):
        recorded = a["detail"].get("local_run")
        if isinstance(recorded, str) and Manifest.written(Path(recorded)):
            return Path(recorded)
        break  # gone or damaged: render it again below
    local = service.run_dir / "attempts" / "soak-target"
    if not Manifest.written(local):
        schedule = _schedule(service, TargetStep.measured(service))
        opts = service.render_options(NAME, rung, service.config.soak_iterations or SOAK_ITERATIONS,
                                      f"{service.run_id}-soak", (schedule.warmup, schedule.decay),
                                      _save_interval(service, schedule))
        service.render(rung, opts, local)
    return local


def _schedule(service: AttemptService, measured: TargetStep) -> SoakSchedule:
    """The soak's learning-rate schedule, sized by what the warm-up measured (recorded as an event)."""
    config = service.config
    fixed = config.soak_iterations
    step_s, source = measured.step(service.cluster, config)
    schedule = soak_schedule(config.soak_duration_s, step_s, source, startup_s=measured.startup_s, iterations=fixed)
    startup = f" after a start-up of {schedule.startup_s:.0f} s" if schedule.startup_s else ""
    warning = expert_load_room(config.model, schedule.expected)
    sized = (f"the {fixed:,} iterations --soak-iterations asks for" if fixed else
             f"the {schedule.expected:,} iterations {config.soak_duration_s:.0f} s take at "
             f"{schedule.step_s:.3f} s a step{startup}, {schedule.source}")
    service.event(NAME, "schedule", f"soak schedule: warm-up {schedule.warmup} iteration(s), cosine decay to a tenth "
                  f"of the peak learning rate at iteration {schedule.decay} ({sized})"
                  + (f"; {warning}" if warning else ""), schedule.to_json() | {"expert_load_warning": warning})
    return schedule


def _save_interval(service: AttemptService, schedule: SoakSchedule) -> int:
    """The configured interval, or (auto) Young/Daly's from the save stall and the MTBF, recorded as an event."""
    if service.config.checkpoint_interval != AUTO:
        return int(service.config.checkpoint_interval)
    interval = checkpoint_interval.for_soak(service, schedule.step_s, schedule.source)
    warning = checkpoint_interval.longer_than_the_soak(interval, schedule.expected)
    service.event(NAME, "checkpoint", f"checkpoint interval (auto): {interval.describe()}"
                  + (f"; {warning}" if warning else ""),
                  {**interval.to_json(), "describe": interval.describe(), "warning": warning})
    return interval.iterations


def _record_goodput(service: AttemptService, local: Path, soak_started: float) -> None:
    """The soak's goodput (rollout/goodput.py) from its fetched metrics and phases and its ledger rows, to now."""
    attempts = service.attempts(NAME)
    if not attempts:
        return  # it never launched
    fetched = local / "fetched"
    figures = goodput.breakdown(soak_started, service.clock.time(), read_metrics(fetched), read_phases(fetched),
                                attempts, service.events(NAME))
    service.event(NAME, "goodput", figures.describe(), figures.to_json())


def _detail(metrics: list[dict[str, Any]], why: str) -> dict[str, Any]:
    last = metrics[-1] if metrics else {}
    return {"why": why, "iterations": last.get("iteration"), "final_loss": last.get("loss")}


def _final_gates(service: AttemptService, rung: str, restarts: int, local: Path) -> None:
    """Judged over the whole soak: every line of the run's metrics file, across its restarts, after the learning
    rate's warm-up the run trains with (its workload.json)."""
    config = service.config
    verdicts = [gates.GateVerdict("no_unrecovered_failure", True, restarts, config.soak_max_restarts,
                                  f"soak completed its duration with {restarts} restart(s)")]
    all_metrics = [m for m in read_metrics(local / "fetched") if m]
    if all_metrics:
        warmup = Workload.load(local).training.warmup_iterations
        verdicts.append(gates.losses_finite(all_metrics))
        verdicts += training_gates.soak_training_gates(all_metrics, warmup, config.thresholds)
    service.judge(NAME, rung, verdicts, _declared(service))
    failed = [v for v in verdicts if not v.passed]
    if failed:
        raise StageFailed(f"soak: gate {failed[0].gate} failed: {failed[0].reason}")


STAGE = Soak()
