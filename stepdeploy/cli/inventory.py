"""`stepdeploy inventory show INVENTORY [--json]`: the cluster an Ansible inventory describes."""

from __future__ import annotations

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from stepdeploy.cli.common import warn_unverified
from stepdeploy.cli.output import emit_json, err, out
from stepdeploy.inventory import Cluster, Node, load_cluster
from stepdeploy.stack import StackProfile

app = typer.Typer(help="Read an Ansible inventory into stepdeploy's cluster model.",
                  epilog="Example: stepdeploy inventory show inventory/dgx.ini --json", no_args_is_help=True)

_STACK_LABELS = (
    ("driver", "driver"), ("cuda", "CUDA"), ("cudnn", "cuDNN"), ("nccl", "NCCL"), ("python", "Python"),
    ("torch", "torch"), ("flash_attn", "flash-attn"), ("megatron_core", "megatron-core"),
)


@app.command(
    "show",
    epilog="Example: stepdeploy inventory show inventory/dgx.ini --json  "
    "(exit 2 with one line on stderr if the inventory is malformed)",
)
def show(
    path: str = typer.Argument(..., help="INI or YAML inventory (group_vars/, host_vars/ beside it apply)."),
    json_output: bool = typer.Option(False, "--json", help="Print the cluster model as JSON on stdout."),
) -> None:
    """Show the nodes, SSH settings, declared GPUs and fabric, and stack profile of an inventory."""
    cluster = load_cluster(path)
    for warning in cluster.warnings:
        err.print(f"warning: {warning}", markup=False)
    warn_unverified(cluster)  # shown, not refused: nothing connects here
    if json_output:
        emit_json(cluster.model_dump(mode="json"))
    else:
        render_cluster(cluster, out)


def render_cluster(cluster: Cluster, console: Console) -> None:
    """The node table and the profile line, written to `console` (a string-backed one in tests)."""
    console.print(node_table(cluster))
    console.print(profile_line(cluster.profile), markup=False)


def node_table(cluster: Cluster) -> Table:
    table = Table(title=f"{cluster.source}: {len(cluster.nodes)} node(s)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("node", "address", "ssh", "GPUs", "model", "arch", "fabric/iface"):
        table.add_column(header, no_wrap=True)
    table.add_column("HCAs", overflow="fold", min_width=12)
    for node in cluster.nodes:
        table.add_row(*_node_cells(node))
    return table


def _node_cells(node: Node) -> tuple[str, ...]:
    ssh = node.ssh
    login = "local" if ssh.connection == "local" else f"{ssh.user or '-'}@{ssh.port}"
    return (
        node.name,
        node.address,
        login,
        _or_dash(node.gpus_per_node),
        _or_dash(node.gpu_model),
        _or_dash(node.arch),
        f"{_or_dash(node.fabric)}/{_or_dash(node.train_iface)}",
        "\n".join(node.ib_hcas) or "-",
    )


def profile_line(profile: StackProfile | None) -> str:
    if profile is None:
        return "profile: none declared (set stepdeploy_profile in group_vars)"
    versions = ", ".join(
        f"{label} {getattr(profile, field)}" for field, label in _STACK_LABELS if getattr(profile, field)
    )
    return f"profile: {profile.name} ({profile.env_manager}): {versions or 'no GPU stack'}"


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)
