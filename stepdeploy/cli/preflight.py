"""`stepdeploy preflight`: is every node, and the cluster as a whole, ready to train?"""

from __future__ import annotations

import re
from pathlib import Path

import typer

from stepdeploy.cli.common import check_host_keys, finite_option, insecure_option
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
    iters: int = typer.Option(20, "--iters", min=1, max=100_000, help="Timed all_reduce calls per size."),
    timeout: float = finite_option(60.0, "--timeout", min=1, max=86400,
                                   help="Seconds a node may take to answer the probe."),
    checkpoint_dir: str = typer.Option("/", "--checkpoint-dir", help="Where checkpoints go (free-disk check)."),
    min_free_gib: float = finite_option(50.0, "--min-free-gib", min=0, help="Free space needed there (at least; "
                                        "with --model, more when the checkpoints need more)."),
    model: str | None = typer.Option(None, "--model", "-m", help="The catalog model the run trains: the disk check "
                                     "asks for room for --keep-checkpoints of its checkpoints plus one in flight."),
    keep_checkpoints: int = typer.Option(2, "--keep-checkpoints", min=1, help="With --model: committed "
                                         "checkpoints the run keeps (as `rollout run --keep-checkpoints`)."),
    layout: str | None = typer.Option(None, "--layout", help="With --model: the layout the run uses (as `render "
                                      "--layout`, e.g. tp=2,cp=2): every node must have the software it needs "
                                      "(TransformerEngine for cp>1)."),
    python: str | None = typer.Option(None, "--python", help="The training environment's python on the nodes "
                                                             "(default: /opt/stepdeploy/venv/bin/python, python3)."),
    insecure: bool = insecure_option(),
) -> None:
    """Per-node and cross-node checks with an all_reduce bandwidth gate.

    Exit codes: 0 all checks pass (warnings allowed), 1 a check failed, 3 a node did not answer.
    """
    import sys

    from stepdeploy.preflight import report as view
    from stepdeploy.preflight import runner
    from stepdeploy.stack import get_profile

    _check_sizes(sizes)
    nodes, declared = _nodes(inventory, local, limit, insecure)
    chosen = get_profile(profile) if profile else declared
    needs = layout_needs(model, layout)
    need_gib, disk_why = checkpoint_space(model, nodes, keep_checkpoints, min_free_gib)
    opts = runner.Options(local=local, checkpoint_dir=checkpoint_dir, min_free_gib=need_gib, disk_why=disk_why,
                          timeout_s=timeout, bandwidth=bandwidth, sizes=sizes, iters=iters,
                          python=python or (sys.executable if local else None), needs=needs)
    result = runner.run(nodes, chosen, opts, progress=info)
    if json_out:
        emit_json(result.to_json())
    else:
        view.render(result, out)
    raise typer.Exit(result.exit_code)


def checkpoint_space(model: str | None, nodes: list, keep: int, floor_gib: float) -> tuple[float, str | None]:
    """(GiB a node needs free, why): room for `keep` committed checkpoints of `model` plus the one being written
    (the planner's checkpoint size per node, plan/checkpoint.py), at least `floor_gib`. Pure."""
    if model is None:
        return floor_gib, None
    from stepdeploy.catalog import load_model
    from stepdeploy.plan import checkpoint
    from stepdeploy.plan.params import count_parameters

    params = count_parameters(load_model(model)).total
    per_node = checkpoint.checkpoint_bytes_per_node(params, nodes[0].gpus_per_node or 0, len(nodes)) / 1024**3
    need = per_node * (keep + 1)
    why = (f"{keep} kept + 1 in flight checkpoints of {model}, {per_node:.3g} GiB each per node by the planner"
           + ("" if need >= floor_gib else f"; --min-free-gib {floor_gib:g} is more"))
    return max(need, floor_gib), why


def layout_needs(model: str | None, layout: str | None) -> tuple[str, ...]:
    """What `layout` of `model` needs on the nodes beyond the stock stack (plan/engines.needs), for preflight's
    transformer_engine check. BadInput for a layout without its model. Pure."""
    if layout is None:
        return ()
    if model is None:
        raise BadInput("--layout needs --model: what a layout needs depends on the model",
                       hint="stepdeploy preflight INVENTORY --model step-3.5-flash --layout tp=2,cp=2")
    from stepdeploy.catalog import load_model
    from stepdeploy.plan import engines
    from stepdeploy.plan.layout import parse_layout

    return tuple(engines.needs(load_model(model), parse_layout(layout)))


# what nccl_bench.parse_size reads, at most 16 sizes of at most 8 GiB (each is one tensor on every GPU)
_SIZE = re.compile(r"([0-9]{1,10})([KMG]?)(i?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def _check_sizes(sizes: str | None) -> None:
    if sizes is None:
        return
    parts = sizes.split(",")
    matches = [_SIZE.fullmatch(part.strip()) for part in parts]
    if len(parts) > 16 or not all(matches) or any(
            int(m[1]) * _UNITS[m[2].upper()] > 8 * 1024**3 for m in matches if m):
        raise BadInput(f"--sizes {sizes!r}: give at most 16 message sizes of at most 8G, e.g. 1M,16M,256M,1G")


def _nodes(inventory: Path | None, local: bool, limit: str | None, insecure: bool):
    from stepdeploy.inventory import load_cluster
    from stepdeploy.preflight.runner import this_machine

    if inventory is None:
        if not local:
            raise BadInput("give an inventory, or --local to check this machine",
                           hint="stepdeploy preflight inventory/dgx.ini  (or: stepdeploy preflight --local)")
        return [this_machine()], None
    cluster = load_cluster(inventory)
    if not local:  # --local connects to nothing
        cluster = check_host_keys(cluster, insecure)
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
