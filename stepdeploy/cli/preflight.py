"""`stepdeploy preflight`: is every node, and the cluster as a whole, ready to train?"""

from __future__ import annotations

from pathlib import Path

import typer

from stepdeploy.cli.output import emit_json, info, out
from stepdeploy.errors import BadInput


def preflight(
    inventory: Path | None = typer.Argument(None, help="Ansible inventory (INI/YAML); optional with --local."),
    local: bool = typer.Option(False, "--local", help="Check this machine, without SSH (how a GPU box runs it)."),
    limit: str | None = typer.Option(None, "--limit", help="Only these inventory hosts (comma-separated)."),
    profile: str | None = typer.Option(None, "--profile", help="Stack profile to check against "
                                                               "(default: the inventory's stepdeploy_profile)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    bandwidth: bool = typer.Option(True, "--bandwidth/--no-bandwidth", help="Run the all_reduce sweep and gate."),
    sizes: str | None = typer.Option(None, "--sizes", help="Sweep message sizes, e.g. 1M,16M,256M,1G "
                                                           "(default: those for NCCL, smaller ones for gloo)."),
    iters: int = typer.Option(20, "--iters", min=1, help="Timed all_reduce calls per size."),
    timeout: float = typer.Option(60.0, "--timeout", min=1, help="Seconds a node may take to answer the probe."),
    checkpoint_dir: str = typer.Option("/", "--checkpoint-dir", help="Where checkpoints go (free-disk check)."),
    min_free_gib: float = typer.Option(50.0, "--min-free-gib", min=0, help="Free space needed there."),
    python: str | None = typer.Option(None, "--python", help="The training environment's python on the nodes "
                                                             "(default: /opt/stepdeploy/venv/bin/python, python3)."),
) -> None:
    """Per-node and cross-node checks with an all_reduce bandwidth gate.

    Exit codes: 0 all checks pass (warnings allowed), 1 a check failed, 3 a node did not answer.
    """
    import sys

    from stepdeploy.preflight import report as view
    from stepdeploy.preflight import runner
    from stepdeploy.stack import get_profile

    nodes, declared = _nodes(inventory, local, limit)
    chosen = get_profile(profile) if profile else declared
    opts = runner.Options(local=local, checkpoint_dir=checkpoint_dir, min_free_gib=min_free_gib,
                          timeout_s=timeout, bandwidth=bandwidth, sizes=sizes, iters=iters,
                          python=python or (sys.executable if local else None))
    result = runner.run(nodes, chosen, opts, progress=info)
    if json_out:
        emit_json(result.to_json())
    else:
        view.render(result, out)
    raise typer.Exit(result.exit_code)


def _nodes(inventory: Path | None, local: bool, limit: str | None):
    from stepdeploy.inventory import load_cluster
    from stepdeploy.preflight.runner import this_machine

    if inventory is None:
        if not local:
            raise BadInput("give an inventory, or --local to check this machine",
                           hint="stepdeploy preflight inventory/dgx.ini  (or: stepdeploy preflight --local)")
        return [this_machine()], None
    cluster = load_cluster(inventory)
    nodes = cluster.nodes
    if limit:
        wanted = [n.strip() for n in limit.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in {x.name for x in nodes}]
        if unknown:
            raise BadInput(f"--limit names hosts the inventory lacks: {', '.join(unknown)}; "
                           f"hosts: {', '.join(x.name for x in nodes)}")
        nodes = [n for n in nodes if n.name in wanted]
    if local and len(nodes) > 1:
        raise BadInput(f"--local checks this machine only, but {len(nodes)} hosts are selected",
                       hint=f"stepdeploy preflight {inventory} --local --limit {nodes[0].name}")
    return nodes, cluster.profile
