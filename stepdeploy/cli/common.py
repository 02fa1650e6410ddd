"""What several commands share: option types that refuse values no command can use, and the gate every
command that connects to nodes passes its inventory through (SSH host-key checking)."""

from __future__ import annotations

import math
from typing import Any

import typer

from stepdeploy.cli.output import warn
from stepdeploy.errors import BadInput
from stepdeploy.inventory import Cluster, load_cluster


def _require_finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def finite_option(default: float | None, *decls: str, **kwargs: Any) -> Any:
    """A float option that refuses nan and inf (a range check alone lets NaN through: every comparison with
    it is false); `kwargs` are typer.Option's (min, max, help)."""
    return typer.Option(default, *decls, callback=_require_finite, **kwargs)


INSECURE_HELP = ("Proceed although the inventory turns SSH host-key checking off (ansible_host_key_checking, "
                 "StrictHostKeyChecking=no); refused otherwise.")


def insecure_option() -> Any:
    return typer.Option(False, "--insecure", help=INSECURE_HELP)


def warn_unverified(cluster: Cluster) -> dict[str, list[str]]:
    """One warning per inventory setting that turns host-key checking off, naming it and its hosts."""
    by_variable: dict[str, list[str]] = {}
    for node in cluster.unverified():
        by_variable.setdefault(str(node.ssh.unverified_by), []).append(node.name)
    for variable, names in by_variable.items():
        warn(f"{variable} turns SSH host-key checking off for {', '.join(names)}")
    return by_variable


def check_host_keys(cluster: Cluster, insecure: bool) -> Cluster:
    """The cluster as a command that connects to its nodes may use it. An inventory that turns host-key
    checking off gets a warning naming the variable, and is refused unless `insecure`; accepted, those nodes'
    connections take unknown keys (SshSettings.host_key_checking False)."""
    by_variable = warn_unverified(cluster)
    if not by_variable:
        return cluster
    if not insecure:
        first = next(iter(by_variable))
        raise BadInput(f"{cluster.source}: the inventory turns SSH host-key checking off ({first}); stepdeploy "
                       "verifies the key of every host it connects to",
                       hint="remove that setting and put the hosts' keys in known_hosts, or pass --insecure to "
                            "connect without verifying them")
    nodes = [node.model_copy(update={"ssh": node.ssh.model_copy(update={"host_key_checking": False})})
             if node.ssh.unverified_by else node for node in cluster.nodes]
    return cluster.model_copy(update={"nodes": nodes})


def connecting_cluster(inventory: str, insecure: bool) -> Cluster:
    """load_cluster for a command that will connect to the nodes (check_host_keys applied)."""
    return check_host_keys(load_cluster(inventory), insecure)
