"""`stepdeploy run launch|status|logs|stop|fetch RUN_DIR`: drive a rendered run on its nodes, over SSH (fabric),
through Slurm, or on this machine without SSH (local).

The run directory's manifest names the nodes, the inventory it was rendered from and the executor it was
rendered for; the inventory gives the SSH settings; remote/registry.py decides the executor (--executor
overrides it). The controller keeps no state: every command can be run from a fresh shell, also after the
controller that launched the run has died.

Exit codes: 0 ok, 1 the run failed / a node could not be stopped cleanly, 2 bad input, 3 nodes unreachable.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import typer

from stepdeploy import safeio
from stepdeploy.cli.common import check_host_keys, finite_option, insecure_option
from stepdeploy.cli.output import emit_json, err, info, out
from stepdeploy.errors import EXIT_FAILED, EXIT_UNREACHABLE, BadInput
from stepdeploy.inventory import load_cluster
from stepdeploy.remote import registry
from stepdeploy.remote.executor import UNREACHABLE, Executor, LogCursor, NodeResult, RunStatus
from stepdeploy.render.manifest import Manifest

app = typer.Typer(help="Launch, follow and stop a rendered run on its nodes (SSH, Slurm, or this machine).",
                  epilog="Example: stepdeploy run launch runs/r1 --follow && stepdeploy run stop runs/r1",
                  no_args_is_help=True)
RUN = typer.Argument(..., help="Run directory written by `stepdeploy render`.")
INVENTORY = typer.Option(None, "--inventory", "-i", help="Inventory (default: the one the run was rendered from).")
JSON = typer.Option(False, "--json", help="Print JSON to stdout.")
INSECURE = insecure_option()
EXECUTOR = typer.Option(None, "--executor", help=f"{registry.HELP} (default: the one the run was rendered for; "
                        "local when every node of the inventory is ansible_connection=local).")


def executor_for_run_dir(run_dir: Path, inventory: str | None, insecure: bool = False,
                 executor: str | None = None) -> Executor:
    """The run's executor: remote/registry.py decides from the manifest, the inventory and `executor`."""
    manifest = Manifest.load(run_dir)
    cluster = load_cluster(inventory or manifest.inventory_path(run_dir / "manifest.json"))
    if registry.kind_for(manifest, cluster, executor) != "local":  # local connects to nothing
        cluster = check_host_keys(cluster, insecure)
    try:
        return registry.create(manifest, cluster, run_dir, requested=executor)
    except KeyError as exc:
        raise BadInput(f"{exc.args[0]}; the run was rendered for other nodes") from None


def _report(results: list[NodeResult], verb: str) -> None:
    for result in results:
        out.print(f"{result.node}: {'ok' if result.ok else 'FAILED'} {result.detail}", markup=False)
    if not all(r.ok for r in results):
        # "unreachable: ..." is what an executor says of a node it could not reach; the rest of a detail may quote
        # what the node sent (a file name), which must not turn a failure into "unreachable"
        unreachable = all(r.detail.startswith("unreachable: ") for r in results if not r.ok)
        raise typer.Exit(EXIT_UNREACHABLE if unreachable else EXIT_FAILED)
    info(f"{verb} on {len(results)} node(s)")


@app.command("launch", epilog="Example: stepdeploy run launch runs/r1 --follow")
def launch(run_dir: Path = RUN, inventory: str | None = INVENTORY,
           follow: bool = typer.Option(False, "--follow", "-f",
                                       help="Stream logs until the run ends; exit as `run status` would then."),
           dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Say what would be done; do nothing."),
           insecure: bool = INSECURE, executor_kind: str | None = EXECUTOR) -> None:
    """Upload the run directory to every node (atomically) and start it detached. With --follow, the exit code
    is the run's: 0 if every node finished cleanly, 1 if it failed, 3 if a node is unreachable."""
    executor = executor_for_run_dir(run_dir, inventory, insecure, executor_kind)
    if dry_run:
        for line in executor.describe(run_dir):
            out.print(line, markup=False)
        return
    with executor:
        _report(executor.prepare(run_dir), "uploaded")
        _report(executor.start(), "started")
        if follow:
            _exit_for(_follow(executor))


def _exit_for(status: RunStatus) -> None:
    """`run status`'s exit code for a run: unreachable node 3, ended and not cleanly 1, else 0."""
    if any(n.state == UNREACHABLE for n in status.nodes):
        raise typer.Exit(EXIT_UNREACHABLE)
    if not status.running and not status.finished_ok:
        raise typer.Exit(EXIT_FAILED)


def _follow(executor: Executor, interval: float = 1.0) -> RunStatus:
    cursor = LogCursor()

    def emit(line: str) -> None:
        out.print(line, markup=False, highlight=False)

    while True:
        status = executor.poll()
        executor.follow(emit, cursor)
        if not status.running:
            executor.follow(emit, cursor)
            _print_status(status)
            return status
        time.sleep(interval)


def _print_status(status: RunStatus) -> None:
    for node in status.nodes:
        code = "" if node.exit_code is None else f" (exit {node.exit_code})"
        out.print(f"{node.node}: {node.state}{code} {node.detail}", markup=False)
        for rank in node.ranks:
            out.print(f"  rank {rank.rank}: {rank.state} pid {rank.pid} iteration {rank.iteration} "
                      f"code {rank.code}", markup=False)
    if not status.running and not status.finished_ok:
        for line in status.culprits():
            err.print(f"cause: {line}", markup=False, soft_wrap=True)


@app.command("status", epilog="Example: stepdeploy run status runs/r1 --json")
def status_cmd(run_dir: Path = RUN, inventory: str | None = INVENTORY, as_json: bool = JSON,
               insecure: bool = INSECURE, executor_kind: str | None = EXECUTOR) -> None:
    """Per node: running / exited (code) / unreachable; per rank: state, last heartbeat iteration."""
    with executor_for_run_dir(run_dir, inventory, insecure, executor_kind) as executor:
        status = executor.poll()
    if as_json:
        emit_json({"nodes": [asdict(n) for n in status.nodes], "culprits": status.culprits()})
    else:
        _print_status(status)
    _exit_for(status)


@app.command("logs", epilog="Example: stepdeploy run logs runs/r1 --follow")
def logs(run_dir: Path = RUN, inventory: str | None = INVENTORY,
         tail: int = typer.Option(50, "--tail", min=1, help="Lines per node."),
         follow: bool = typer.Option(False, "--follow", "-f",
                                     help="Stream until the run ends; exit as `run status` would then."),
         insecure: bool = INSECURE, executor_kind: str | None = EXECUTOR) -> None:
    """Every node's log, each line prefixed with its node (the workload adds [rank R])."""
    with executor_for_run_dir(run_dir, inventory, insecure, executor_kind) as executor:
        if follow:
            _exit_for(_follow(executor))
            return
        for lines in executor.logs(tail).values():
            for line in lines:
                out.print(line, markup=False, highlight=False)


@app.command("stop", epilog="Example: stepdeploy run stop runs/r1 --grace 10")
def stop(run_dir: Path = RUN, inventory: str | None = INVENTORY,
         grace: float = finite_option(10.0, "--grace", min=0, max=86400, help="Seconds between SIGTERM and "
                                      "SIGKILL."),
         insecure: bool = INSECURE, executor_kind: str | None = EXECUTOR) -> None:
    """SIGTERM the run's processes on every node, SIGKILL after the grace, and prove none is left."""
    with executor_for_run_dir(run_dir, inventory, insecure, executor_kind) as executor:
        results = executor.stop(grace)
    _report([NodeResult(r.node, r.ok, r.detail) for r in results], "stopped; nothing of the run is left")


@app.command("fetch", epilog="Example: stepdeploy run fetch runs/r1")
def fetch(run_dir: Path = RUN, inventory: str | None = INVENTORY,
          dest: Path | None = typer.Option(None, "--dest", help="Default: RUN_DIR/fetched."),
          insecure: bool = INSECURE, executor_kind: str | None = EXECUTOR) -> None:
    """Copy metrics, status, heartbeats, logs and exit codes (not checkpoints) back from every node."""
    safeio.check_output_dir(dest or run_dir / "fetched", "fetched files")
    with executor_for_run_dir(run_dir, inventory, insecure, executor_kind) as executor:
        _report(executor.fetch(dest or run_dir / "fetched"), "fetched")
