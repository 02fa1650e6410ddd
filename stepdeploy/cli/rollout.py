"""`stepdeploy rollout run|resume|status|stop|list`: the staged, gated, resumable rollout."""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import typer
from rich.live import Live as RichLive
from rich.table import Table

from stepdeploy import corpus, safeio
from stepdeploy.cli.common import connecting_cluster, finite_option, insecure_option
from stepdeploy.cli.output import emit_json, err, info, out, warn
from stepdeploy.cli.rollout_checks import (
    check_before_rollout,
    check_run_name,
    default_run_name,
    model_argument,
    print_plan,
)
from stepdeploy.errors import EXIT_FAILED, BadInput, StepdeployError
from stepdeploy.inventory.model import Cluster
from stepdeploy.ledger import Ledger, LedgerLocked, controller_lock
from stepdeploy.remote import registry
from stepdeploy.render.options import parse_env
from stepdeploy.rollout import gates
from stepdeploy.rollout.config import (
    AUTO,
    RolloutConfig,
    StageFailed,
    StageStopped,
    parse_checkpoint_interval,
    parse_duration,
    parse_mtbf,
)
from stepdeploy.rollout.inject import parse_all as parse_injections
from stepdeploy.rollout.stage_names import parse_stages

app = typer.Typer(help="Staged rollout: warmup, scaling ladder, soak — gated, resumable, recorded in a ledger.",
                  epilog="Example: stepdeploy rollout run -i inventory/examples/hgx-h100-pair.ini "
                  "--model step-3.5-flash-slice-ep2 --run-dir runs/r1 && stepdeploy rollout status runs/r1",
                  no_args_is_help=True)
RUN = typer.Argument(..., help="The run directory (holds ledger.sqlite).")
INSECURE = insecure_option()


@app.command("run", epilog="Example: stepdeploy rollout run -i inventory/examples/hgx-h100-pair.ini "
             "--model step-3.5-flash-slice-ep2 --stages warmup,scale,soak --soak-duration 72h")
def run_cmd(  # long: a flat table of 26 Typer options (44 lines); the body is 27 lines
    inventory: str = typer.Option(..., "--inventory", "-i", help="Ansible inventory."),
    model: str = typer.Option(..., "--model", "-m", help="Target catalog model."),
    stages: str = typer.Option("warmup,scale,soak", "--stages", help="Comma-separated: warmup,scale,soak."),
    soak_duration: str = typer.Option("72h", "--soak-duration", help="e.g. 90s, 10m, 72h."),
    soak_iterations: int | None = typer.Option(None, "--soak-iterations", min=2, help="Soak: end after N "
                                               "iterations, the same on any machine (--soak-duration then only "
                                               "limits it)."),
    checkpoint_interval: str = typer.Option("20", "--checkpoint-interval", help="Soak: checkpoint every N steps, or "
                                            "auto (Young/Daly's interval from the measured save stall and --mtbf)."),
    mtbf: str | None = typer.Option(None, "--mtbf", help="With --checkpoint-interval auto: the job's mean time "
                                    "between failures, e.g. 6h (default: Llama 3's failure rate per GPU x the "
                                    "cluster's GPUs)."),
    keep_checkpoints: int = typer.Option(2, "--keep-checkpoints", min=1, help="Committed checkpoints kept on "
                                         "the nodes (the newest K); preflight's disk check counts K + 1."),
    warmup_iterations: int = typer.Option(10, "--warmup-iterations", min=1),
    scale_iterations: int = typer.Option(30, "--scale-iterations", min=2),
    layout: str | None = typer.Option(None, "--layout", help="Target layout (default: the planner's best)."),
    min_scaling_efficiency: float = finite_option(0.7, "--min-scaling-efficiency", min=0.0),
    max_step_time: float | None = finite_option(None, "--max-step-time", min=0.0,
                                                help="Gate: steady step time ceiling, s."),
    pg_timeout: int = typer.Option(60, "--pg-timeout", min=1, help="Process-group timeout, s."),
    seq: int | None = typer.Option(None, "--seq", min=1, help="Sequence length (default: each model's)."),
    gbs: int | None = typer.Option(None, "--gbs", min=1, help="Global batch size (default: each model's)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Default: runs/<model>-<UTC time>."),
    executor: str | None = typer.Option(None, "--executor", help=f"{registry.HELP} (default: the inventory's "
                                        "stepdeploy_executor, else local when every host is "
                                        "ansible_connection=local, else fabric)."),
    inject: list[str] = typer.Option([], "--inject", help="Soak fault, repeatable: kill:rank=last@10m, "
                                     "hang:rank=0@20m, link-down:node=2@30m,for=90s, node-loss:node=2@40m "
                                     "(times from the soak's start; rank: N|first|last; node: 1-based "
                                     "index|name|first|last)."),
    heartbeat_timeout: str = typer.Option("180s", "--heartbeat-timeout", help="Soak: a rank without a heartbeat "
                                          "this long is hung (longer than a checkpoint save)."),
    monitor_interval: str = typer.Option("5s", "--monitor-interval", help="Soak: how often the monitors read "
                                         "every node."),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0, help="Soak: restarts from checkpoint allowed."),
    data: Path | None = typer.Option(None, "--data", help="A dataset `stepdeploy data prepare` wrote (its prefix); "
                                     "default: synthetic tokens."),
    env: list[str] = typer.Option([], "--env", help="Extra KEY=VALUE for every rank of every stage (rendered into "
                                  "env.sh, kept in the ledger: no secrets), e.g. STEPDEPLOY_PROFILE_FIRST=1."),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Print every stage, rung and gate; start nothing."),
    insecure: bool = INSECURE,
) -> None:
    """Start a rollout. Exit 0 all stages passed, 1 a gate failed (resume with `rollout resume RUN`)."""
    model = model_argument(model)  # a model file by its absolute path: `rollout resume` runs from anywhere
    config = RolloutConfig(inventory=str(Path(inventory).resolve()), model=model, stages=parse_stages(stages),
                           layout=layout, warmup_iterations=warmup_iterations, scale_iterations=scale_iterations,
                           soak_duration_s=parse_duration(soak_duration), soak_iterations=soak_iterations,
                           checkpoint_interval=parse_checkpoint_interval(checkpoint_interval), mtbf_s=parse_mtbf(mtbf),
                           keep_checkpoints=keep_checkpoints, pg_timeout_s=pg_timeout, seq_length=seq,
                           global_batch_size=gbs, executor=executor, inject=tuple(inject),
                           heartbeat_timeout_s=parse_duration(heartbeat_timeout),
                           monitor_interval_s=parse_duration(monitor_interval), soak_max_restarts=max_restarts,
                           data=str(data.resolve()) if data else None, extra_env=parse_env(env),
                           thresholds=gates.Thresholds(min_scaling_efficiency=min_scaling_efficiency,
                                                       max_step_time_s=max_step_time))
    config = _checked(config, data)
    run_id = run_dir.name if run_dir else default_run_name(model, time.gmtime())
    check_run_name(run_id)
    run_dir = run_dir or Path("runs") / run_id
    # Everything the rollout will need is checked before its directory and ledger exist (nothing half-made).
    cluster = check_before_rollout(config, insecure)
    if dry_run:
        print_plan(config, cluster)
        return
    _make_run_dir(run_dir)
    with controller_lock(run_dir):
        ledger = Ledger(run_dir / "ledger.sqlite")
        ledger.create_run(run_id, config.to_json(), list(config.stages))
        _drive(run_dir, ledger, run_id, config, cluster)


def _checked(config: RolloutConfig, data: Path | None) -> RolloutConfig:
    """`rollout run`'s options judged together (exit 2 on the first that is wrong), before anything is made."""
    parse_injections(config.inject)  # a bad --inject exits 2 before anything starts
    if data is not None:
        from stepdeploy.catalog import load_model
        from stepdeploy.render.run import check_dataset

        # missing, changed or too wide for the model
        check_dataset(corpus.load_prepared(data), load_model(config.model))
    if config.heartbeat_timeout_s <= 0 or config.monitor_interval_s <= 0:
        raise BadInput("--heartbeat-timeout and --monitor-interval must be longer than 0 s")
    registry.check_kind(config.executor)
    if config.inject and "soak" not in config.stages:
        raise BadInput("--inject acts during the soak; add soak to --stages")
    if config.mtbf_s is not None and config.checkpoint_interval != AUTO:
        raise BadInput("--mtbf is what --checkpoint-interval auto computes the interval from",
                       hint="add --checkpoint-interval auto, or drop --mtbf")
    return config.checked()


def _make_run_dir(run_dir: Path) -> None:
    """A new rollout's directory: never over a file or another rollout's ledger."""
    if run_dir.exists() and not run_dir.is_dir():
        raise BadInput(f"{run_dir} exists and is not a directory; give another --run-dir")
    if (run_dir / "ledger.sqlite").exists():
        raise BadInput(f"{run_dir} already holds a rollout", hint=f"stepdeploy rollout resume {run_dir}")
    safeio.check_output_dir(run_dir, "rollout")
    run_dir.mkdir(parents=True, exist_ok=True)


@app.command("resume", epilog="Example: stepdeploy rollout resume runs/r1 --min-scaling-efficiency 0.5")
def resume_cmd(
    run_dir: Path = RUN,
    min_scaling_efficiency: float | None = finite_option(None, "--min-scaling-efficiency", min=0.0),
    max_step_time: float | None = finite_option(None, "--max-step-time", min=0.0),
    insecure: bool = INSECURE,
) -> None:
    """Continue a rollout: finished stages are not re-run; a running one is re-attached or restarted."""
    ledger, run_id = _open(run_dir)
    check_run_name(run_id)
    config = _config(ledger, run_id)
    cluster = check_before_rollout(config, insecure)
    with controller_lock(run_dir):
        (run_dir / "STOP").unlink(missing_ok=True)
        changes = {k: v for k, v in {"min_scaling_efficiency": min_scaling_efficiency,
                                     "max_step_time_s": max_step_time}.items() if v is not None}
        if changes:
            config = replace(config, thresholds=replace(config.thresholds, **changes))
            ledger.event(run_id, "config", f"thresholds changed on resume: {changes}")
        _drive(run_dir, ledger, run_id, config, cluster)


def _config(ledger: Ledger, run_id: str) -> RolloutConfig:
    return RolloutConfig.from_json(ledger.run(run_id)["config"], f"{ledger.path}: run {run_id}: config")


def _drive(run_dir: Path, ledger: Ledger, run_id: str, config: RolloutConfig, cluster: Cluster) -> None:
    # The controller's machinery (SSH, rendering) loads only when a rollout really runs: other commands stay fast.
    from stepdeploy.rollout.runner import Rollout
    from stepdeploy.rollout.view import PlainReporter, render
    from stepdeploy.sim import faults as sim_faults

    # the simulated cluster's link-down and node-loss act from the host (None: on real nodes)
    rollout = Rollout(run_dir, ledger, run_id, config, cluster=cluster, faults=sim_faults.for_cluster(cluster))
    try:
        if err.is_terminal:
            with RichLive(console=err, refresh_per_second=2, transient=True) as live:
                rollout.service.on_tick = lambda lv: live.update(render(ledger, run_id, lv, time.time()))
                rollout.run()
        else:
            plain = PlainReporter(ledger, run_id, err)
            rollout.service.on_tick = plain
            try:
                rollout.run()
            finally:
                plain.flush_events()
    except StageStopped as exc:  # not a failure: no cause to fix; `rollout resume` continues it when wanted
        err.print(f"stopped: {exc.message}", markup=False, soft_wrap=True)
        _print_status(ledger, run_id)
        raise typer.Exit(EXIT_FAILED) from None
    except StageFailed as exc:
        err.print(f"error: {exc.message}", markup=False, soft_wrap=True)
        err.print(f"hint: fix the cause (or a threshold), then: stepdeploy rollout resume {run_dir}", markup=False)
        _print_status(ledger, run_id)
        raise typer.Exit(EXIT_FAILED) from None
    _print_status(ledger, run_id)
    info(f"report: stepdeploy report {run_dir}")


def _open(run_dir: Path) -> tuple[Ledger, str]:
    if not run_dir.is_dir():
        raise BadInput(f"{run_dir}: not a run directory", hint="stepdeploy rollout list")
    if not (run_dir / "ledger.sqlite").exists():
        raise BadInput(f"{run_dir}: no rollout ledger here", hint="stepdeploy rollout list")
    ledger = Ledger(run_dir / "ledger.sqlite", create=False)
    ids = ledger.run_ids()
    if not ids:
        raise BadInput(f"{run_dir}: the ledger holds no run")
    return ledger, ids[-1]


@app.command("status", epilog="Example: stepdeploy rollout status runs/r1 --json")
def status_cmd(run_dir: Path = RUN, json_out: bool = typer.Option(False, "--json")) -> None:
    """Stages, rungs, attempts and gate verdicts of a rollout."""
    ledger, run_id = _open(run_dir)
    if json_out:
        emit_json({"run": ledger.run(run_id), "stages": [asdict(s) for s in ledger.stages(run_id)],
                   "rungs": ledger.rungs(run_id, "scale"), "attempts": ledger.attempts(run_id),
                   "verdicts": ledger.verdicts(run_id)})
        return
    _print_status(ledger, run_id)


def _print_status(ledger: Ledger, run_id: str) -> None:
    run = ledger.run(run_id)
    table = Table(title=f"rollout {run_id}: {run['status']}", title_justify="left")
    for col in ("stage", "status", "reason"):
        table.add_column(col)
    for s in ledger.stages(run_id):
        table.add_row(s.name, s.status, s.reason or "")
    out.print(table)
    gates_table = Table(title="gates", title_justify="left")
    for col in ("stage/rung", "gate", "verdict", "reason"):
        gates_table.add_column(col)
    for v in ledger.verdicts(run_id):
        gates_table.add_row(f"{v['stage']}/{v['rung']}", v["gate"], "pass" if v["passed"] else "FAIL", v["reason"])
    out.print(gates_table)


@app.command("stop", epilog="Example: stepdeploy rollout stop runs/r1")
def stop_cmd(run_dir: Path = RUN, insecure: bool = INSECURE) -> None:
    """Stop a rollout: its processes on every node (proved gone), and its controller if one runs."""
    ledger, run_id = _open(run_dir)
    cluster = connecting_cluster(_config(ledger, run_id).inventory, insecure)  # all checked before the STOP
    (run_dir / "STOP").write_text("stop requested\n")
    ledger.event(run_id, "stop", "stop requested")
    from stepdeploy.rollout.attempt import executor_for

    running = [a for a in ledger.attempts(run_id) if a["status"] == "running"]
    _let_the_controller_stop(run_dir, ledger, [a["id"] for a in running])
    left = []
    for attempt in running:  # (again) stop and prove: the job cancelled (slurm), no process left on any node
        try:
            with executor_for(cluster, Path(str(attempt["detail"].get("local_run")))) as executor:
                results = executor.stop()
        except BadInput as exc:  # its run directory is gone or damaged: its nodes are not known
            left.append(f"attempt {attempt['id']}: {exc.message}")
            continue
        left += [f"{r.node}: {r.detail}" for r in results if not r.ok]
    try:
        with controller_lock(run_dir):  # no controller: record the stop ourselves
            for attempt in ledger.attempts(run_id):
                if attempt["status"] == "running":
                    ledger.finish_attempt(attempt["id"], "stopped", {"why": "rollout stop"})
            running = [s for s in ledger.stages(run_id) if s.status == "running"]
            for s in running:
                ledger.set_stage(run_id, s.name, "stopped", "rollout stop")
            ledger.set_run_status(run_id, "stopped")
    except LedgerLocked:
        info("a controller is running this rollout; it will record the stop")
    if left:
        raise StepdeployError("processes still running after stop: " + "; ".join(left))
    info(f"stopped {run_id}; nothing of it runs on any node")


def _let_the_controller_stop(run_dir: Path, ledger: Ledger, attempt_ids: list[int], wait_s: float = 90.0) -> None:
    """A running controller sees STOP at its next poll and stops its attempt itself; stopping the processes
    under it first would look like a failed run to it (and a soak would restart it). Wait for that."""
    try:
        with controller_lock(run_dir):
            return  # no controller
    except LedgerLocked:
        pass
    info("a controller is running this rollout; waiting for it to stop its attempt")
    until = time.monotonic() + wait_s
    run_id = ledger.run_ids()[-1]
    while time.monotonic() < until:
        states = {a["id"]: a["status"] for a in ledger.attempts(run_id)}
        between = not attempt_ids and any(s.status == "running" for s in ledger.stages(run_id))
        if not between and all(states.get(i) != "running" for i in attempt_ids):
            return  # (no attempt running but a stage is: a restart in progress; wait for the controller's stop)
        try:
            with controller_lock(run_dir):
                return  # the controller has exited
        except LedgerLocked:
            time.sleep(1.0)


@app.command("list", epilog="Example: stepdeploy rollout list --runs runs")
def list_cmd(runs: Path = typer.Option(Path("runs"), "--runs", help="Directory of run directories."),
             json_out: bool = typer.Option(False, "--json")) -> None:
    """Every rollout under --runs with its status (a ledger that cannot be read is named, and exits 2)."""
    rows, unreadable = [], []
    for ledger_path in sorted(runs.glob("*/ledger.sqlite")):
        try:
            ledger = Ledger(ledger_path, create=False)
        except BadInput as exc:
            warn(exc.message)
            unreadable.append(str(ledger_path))
            continue
        for run_id in ledger.run_ids():
            run = ledger.run(run_id)
            model = run["config"].get("model")
            rows.append({"run": run_id, "dir": str(ledger_path.parent), "status": run["status"],
                         "model": model if isinstance(model, str) else None, "created": run["created"]})
        ledger.close()
    if json_out:
        emit_json(rows)
    else:
        _list_table(rows)
    if unreadable:
        raise BadInput(f"{len(unreadable)} ledger(s) under {runs} could not be read: {', '.join(unreadable)}")


def _list_table(rows: list[dict]) -> None:
    table = Table()
    for col in ("run", "status", "model", "dir"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["run"], r["status"], r["model"] or "", r["dir"])
    out.print(table)
