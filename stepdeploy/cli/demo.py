"""`stepdeploy demo`: the main job on the embedded simulated cluster.

Today: start the cluster, show the inventory it is described by, ping every node with Ansible, tear the
cluster down. Later issues grow it into provision -> preflight -> plan -> rollout -> report.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import typer
from rich.status import Status
from rich.table import Table

from stepdeploy import ansible_run
from stepdeploy.cli.inventory import render_cluster
from stepdeploy.cli.output import err, info, out
from stepdeploy.errors import StepdeployError, Unreachable
from stepdeploy.inventory import load_cluster
from stepdeploy.sim.cluster import SimConfig, down, up


def demo(
    nodes: int = typer.Option(2, "--nodes", "-N", help="Nodes in the simulated cluster."),
    keep: bool = typer.Option(False, "--keep", help="Leave the cluster running afterwards."),
) -> None:
    """Run the pipeline on the embedded simulated cluster (needs root): up, inventory, ping, down."""
    cfg = SimConfig()
    started = time.monotonic()
    try:
        _step(f"1. sim up --nodes {nodes}")
        with err.status("starting the simulated cluster (the first run builds the base image)") as spin:
            up(cfg, nodes, progress=lambda msg: _progress(spin, msg))
        _step(f"2. inventory show {cfg.inventory}")
        render_cluster(load_cluster(cfg.inventory), out)
        _step("3. Ansible ping of every node (ansible-runner, host keys verified)")
        _ping(cfg.inventory)
    finally:
        if not keep:
            _step("4. sim down")
            report = down(cfg, progress=info)
            if report.leftovers:
                raise StepdeployError("still present after sim down: " + "; ".join(report.leftovers))
    info(f"demo finished in {time.monotonic() - started:.1f} s")


def _step(title: str) -> None:
    err.rule(title, align="left")


def _progress(spinner: Status, msg: str) -> None:
    spinner.update(msg)
    if not err.is_terminal:
        info(msg)


def _ping(inventory: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="stepdeploy-ping-") as tmp:
        run = ansible_run.run(Path(tmp), inventory, host_pattern="all", module="ansible.builtin.ping")
        table = Table(title="ansible.builtin.ping")
        table.add_column("node")
        table.add_column("result")
        unreachable = []
        for event in run.events:
            data = event.get("event_data", {})
            if event["event"] == "runner_on_ok":
                table.add_row(data["host"], data["res"].get("ping", "?"))
            elif event["event"] in ("runner_on_unreachable", "runner_on_failed"):
                table.add_row(data["host"], "UNREACHABLE")
                unreachable.append(data["host"])
        out.print(table)
    if unreachable or run.status != "successful":
        raise Unreachable(f"ping failed on {', '.join(unreachable) or 'the cluster'} ({run.status})")
