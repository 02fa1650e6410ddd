"""`stepdeploy sim up|down|status|ssh|publish`: the embedded simulated cluster."""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer
from rich.table import Table

from stepdeploy.cli.output import emit_json, err, info, out
from stepdeploy.errors import BadInput, StepdeployError
from stepdeploy.sim import repo
from stepdeploy.sim import state as statefile
from stepdeploy.sim.cluster import SimConfig, down, status, up

app = typer.Typer(
    help="The embedded simulated cluster: Debian nodes in network namespaces with real sshd, apt and Python.",
    epilog="Example: stepdeploy sim up --nodes 2 && stepdeploy sim status",
    no_args_is_help=True,
)

NAME = typer.Option("sim", "--name", help="Cluster name (1-8 lowercase letters/digits); several can coexist.")
SUBNET = typer.Option("10.77.0.0/24", "--subnet", help="Private subnet of the cluster's bridge.")
JSON = typer.Option(False, "--json", help="Print machine-readable JSON to stdout.")


def _config(name: str, subnet: str = "10.77.0.0/24") -> SimConfig:
    return SimConfig(name=name, subnet=subnet)


@app.command("up", epilog="Example: stepdeploy sim up --nodes 2")
def up_cmd(
    nodes: int = typer.Option(2, "--nodes", "-N", help="How many nodes the cluster should have."),
    name: str = NAME,
    subnet: str = SUBNET,
    json_out: bool = JSON,
) -> None:
    """Start (or grow) the simulated cluster and write its Ansible inventory. Safe to repeat."""
    cfg = _config(name, subnet)
    started = time.monotonic()
    with err.status("starting the simulated cluster") as spinner:
        def progress(msg: str) -> None:
            spinner.update(msg)
            if not err.is_terminal:
                info(msg)
        sim = up(cfg, nodes, progress=progress)
    elapsed = time.monotonic() - started
    if json_out:
        emit_json({**status(cfg), "seconds": round(elapsed, 2)})
        return
    info(f"cluster {sim.name!r}: {len(sim.nodes)} node(s) up in {elapsed:.1f} s")
    out.print(f"inventory: {cfg.inventory}")
    out.print(f"next: stepdeploy inventory show {cfg.inventory}")


@app.command("down", epilog="Example: stepdeploy sim down")
def down_cmd(
    name: str = NAME,
    purge: bool = typer.Option(False, "--purge", help="Also delete keys and the published repository."),
    json_out: bool = JSON,
) -> None:
    """Stop every node and remove every namespace, veth, mount and process the cluster created."""
    cfg = _config(name)
    started = time.monotonic()
    report = down(cfg, purge=purge, progress=info)
    elapsed = time.monotonic() - started
    if json_out:
        emit_json({"removed": report.removed, "leftovers": report.leftovers, "seconds": round(elapsed, 2)})
    if report.leftovers:
        raise StepdeployError("still present after sim down: " + "; ".join(report.leftovers))
    if not json_out:
        info(f"down in {elapsed:.1f} s; nothing of cluster {name!r} is left")


@app.command("status", epilog="Example: stepdeploy sim status --json")
def status_cmd(name: str = NAME, json_out: bool = JSON) -> None:
    """Show the nodes of the simulated cluster and whether their sshd answers. Exit 1 if any does not."""
    cfg = _config(name)
    data = status(cfg)
    if json_out:
        emit_json(data)
    elif not data["nodes"]:
        out.print(f"no simulated cluster {name!r} (state dir {cfg.dir})")
    else:
        table = Table(title=f"simulated cluster {name!r}")
        for col in ("node", "address", "pid", "running", "sshd"):
            table.add_column(col)
        for n in data["nodes"]:
            table.add_row(n["name"], n["address"], str(n["pid"]), _mark(n["running"]), _mark(n["ssh"]))
        out.print(table)
        out.print(f"repository: {data['repository']}  inventory: {data['inventory']}")
    if data["nodes"] and not data["up"]:
        raise typer.Exit(1)


def _mark(ok: bool) -> str:
    return "yes" if ok else "NO"


@app.command(
    "ssh",
    epilog="Example: stepdeploy sim ssh node1 -- uname -a",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def ssh_cmd(
    node: str = typer.Argument(..., help="Node name, e.g. node1."),
    command: list[str] | None = typer.Argument(None, help="Command to run instead of a login shell."),
    name: str = NAME,
) -> None:
    """Open a shell (or run a command) on a node over SSH, with strict host-key checking."""
    cfg = _config(name)
    sim = statefile.load_state(cfg.dir)
    if sim is None:
        raise BadInput(f"no simulated cluster {name!r} is up", hint="stepdeploy sim up")
    target = sim.node(node)
    if target is None:
        raise BadInput(f"no node {node!r}; nodes: {', '.join(n.name for n in sim.nodes)}")
    argv = ["ssh", "-i", str(cfg.client_key), "-o", f"UserKnownHostsFile={cfg.known_hosts}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"root@{target.address}"]
    if command:
        argv += ["--", *command]
    os.execvp("ssh", argv)


@app.command("publish", epilog="Example: stepdeploy sim publish hello_2.10-3_amd64.deb torch-2.13.0-*.whl")
def publish_cmd(
    files: list[Path] = typer.Argument(..., help=".deb files (apt repository) or .whl files (wheelhouse)."),
    name: str = NAME,
) -> None:
    """Add packages to the repository the nodes install from (apt: .deb; pip: .whl)."""
    cfg = _config(name)
    if statefile.load_state(cfg.dir) is None:
        raise BadInput(f"no simulated cluster {name!r} is up", hint="stepdeploy sim up")
    for path in repo.publish(cfg.dir, files):
        out.print(path)
