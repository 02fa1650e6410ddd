"""`stepdeploy provision INVENTORY`: run the roles with a live per-host view, then a recap."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from stepdeploy import safeio
from stepdeploy.cli.common import connecting_cluster, insecure_option
from stepdeploy.cli.output import emit_json, err, info, out
from stepdeploy.errors import EXIT_FAILED, EXIT_UNREACHABLE, StepdeployError
from stepdeploy.provision.progress import Progress
from stepdeploy.provision.runner import ProvisionRequest, ProvisionResult, run

_STYLE = {"failed": "red", "unreachable": "red", "done": "green", "running": "yellow"}


def provision(
    inventory: Path = typer.Argument(..., help="INI or YAML inventory with a stepdeploy_profile."),
    check: bool = typer.Option(False, "--check", help="Show what would change; change nothing."),
    diff: bool = typer.Option(False, "--diff", help="Show file differences."),
    tags: str | None = typer.Option(None, "--tags", help="Only these role tags (comma-separated)."),
    limit: str | None = typer.Option(None, "--limit", help="Only these hosts or groups (Ansible pattern)."),
    log_dir: Path | None = typer.Option(None, "--log-dir", help="Where ansible-runner's artifacts go."),
    facts_dir: Path | None = typer.Option(
        None, "--facts-dir", help="Where each node's NCCL facts are saved as NODE.json (default: .stepdeploy/facts "
        "next to the inventory; `stepdeploy render` reads them from there)."),
    json_out: bool = typer.Option(False, "--json", help="Print the recap as JSON to stdout."),
    insecure: bool = insecure_option(),
) -> None:
    """Provision every node: facts + compatibility check first (nothing changes on a conflict), then the
    roles common, nvidia_driver, cuda_toolkit, nccl, python_env, infiniband; each node's NCCL facts are
    brought back to --facts-dir for `stepdeploy render`. Exit 0 ok, 1 a task failed, 2 bad inventory,
    3 a node unreachable."""
    # ansible connects as the inventory says: one that turns host-key checking off is refused unless --insecure
    connecting_cluster(str(inventory), insecure)
    if log_dir is not None:
        safeio.check_output_dir(log_dir, "provisioning logs")
    if facts_dir is not None:
        safeio.check_output_dir(facts_dir, "NCCL facts")
    request = ProvisionRequest(inventory=inventory, check=check, diff=diff, tags=tags, limit=limit,
                               log_dir=log_dir, facts_dir=facts_dir)
    started = time.monotonic()
    if err.is_terminal:
        with Live(console=err, refresh_per_second=4, transient=True) as live:
            result = run(request, on_event=lambda p, _line: live.update(live_view(p, started)))
    else:
        result = run(request, on_event=lambda _p, line: info(line) if line else None)
    if not result.progress.hosts and result.status != "successful":
        tail = result.stdout_log.read_text().strip().splitlines()[-8:]
        raise StepdeployError("ansible-playbook stopped before reaching any host: " + " | ".join(tail),
                              hint=f"full log: {result.stdout_log}")
    if json_out:
        emit_json({**result.progress.summary(), "status": result.status, "check": check,
                   "log_dir": str(result.log_dir), "seconds": round(result.seconds, 2),
                   "facts_dir": str(result.facts_dir), "facts": list(result.facts_saved)})
    else:
        render_recap(result, out)
    if result.progress.any_unreachable:
        raise typer.Exit(EXIT_UNREACHABLE)
    if result.status != "successful" or result.progress.any_failed:
        raise typer.Exit(EXIT_FAILED)


def live_view(progress: Progress, started: float) -> Group:
    table = Table(box=None, pad_edge=False)
    for col in ("host", "current task", "ok", "changed", "failed", "skipped"):
        table.add_column(col, justify="right" if col in ("ok", "changed", "failed", "skipped") else "left")
    for h in progress.hosts.values():
        table.add_row(Text(h.name, style=_STYLE[h.status]), h.task[:70], str(h.ok), str(h.changed),
                      str(h.failed), str(h.skipped))
    head = Text(f"play {progress.plays}: {progress.play}  ·  task {progress.tasks}  ·  "
                f"{time.monotonic() - started:.0f} s", style="bold")
    return Group(head, table)


def render_recap(result: ProvisionResult, console: Console) -> None:
    table = Table(title=f"provision recap ({result.status}, {result.seconds:.1f} s)", title_justify="left")
    for col in ("host", "ok", "changed", "failed", "skipped", "unreachable", "status"):
        table.add_column(col)
    for h in result.progress.hosts.values():
        table.add_row(h.name, str(h.ok), str(h.changed), str(h.failed), str(h.skipped),
                      "yes" if h.unreachable else "", Text(h.status, style=_STYLE[h.status]))
    console.print(table)
    for f in result.progress.failures:
        console.print(Text(f"FAILED {f.host}: {f.task}", style="red bold"))
        for line in f.message.splitlines():
            console.print(Text(f"  {line}"))
    if result.facts_saved:
        console.print(f"NCCL facts of {', '.join(result.facts_saved)}: {result.facts_dir}", markup=False)
    console.print(f"full log: {result.stdout_log}")
