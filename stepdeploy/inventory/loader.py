"""load_cluster: an inventory file -> a validated Cluster, or one BadInput line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stepdeploy import safeio, seed
from stepdeploy.errors import BadInput
from stepdeploy.inventory.ansible_source import YAML_SUFFIXES, RawHost, read_inventory
from stepdeploy.inventory.model import Cluster, Node, SlurmSettings
from stepdeploy.inventory.nodes import CLUSTER_VARS, build_node, cluster_settings, wanted
from stepdeploy.stack import get_profile

EXAMPLE = "inventory/dgx.ini"


def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    """Parse an INI or YAML inventory (with its group_vars/ and host_vars/) into a Cluster.

    Every problem with the input is raised as BadInput with one line naming the file, the host and the
    variable, what was wrong and what is valid; no other exception escapes.
    """
    try:
        shipped = seed.shipped_inventory(path)  # a help example's inventory/dgx.ini, run outside a checkout
        if shipped is not None:
            cluster = _load(shipped)
            note = f"{path} is not here: using the copy shipped with stepdeploy, {shipped} (copy it to edit it)"
            return cluster.model_copy(update={"warnings": [note, *cluster.warnings]})
        return _load(Path(path))
    except BadInput as exc:
        raise BadInput(_printable(exc.message), hint=exc.hint) from None
    except (OSError, ValueError) as exc:  # e.g. a path the OS refuses; NUL bytes in the name
        raise BadInput(_printable(f"{path}: cannot read the inventory: {exc}")) from None


def _load(source: Path) -> Cluster:
    _check_file(source)
    _check_vars_dirs(source)
    raw = read_inventory(source, wanted)
    if not raw.hosts:
        raise BadInput(f"{source}: the inventory lists no hosts; add at least one host, "
                       "e.g. `node1 ansible_host=192.0.2.11` under a [group] header")
    built = [build_node(host, source) for host in raw.hosts]
    nodes = [node for node, _ in built]
    _check_unique_addresses(source, nodes)
    profile = _shared_profile(source, [(node.name, name) for node, name in built])
    settings = _shared_settings(source, raw.hosts)
    slurm = SlurmSettings(controller=settings.get("stepdeploy_slurm_controller"),
                          partition=settings.get("stepdeploy_slurm_partition"),
                          tasks=settings.get("stepdeploy_slurm_tasks", "node"))
    return Cluster(source=source, nodes=nodes, profile=get_profile(profile) if profile else None,
                   warnings=raw.warnings, executor=settings.get("stepdeploy_executor"), slurm=slurm)


def _shared_settings(source: Path, hosts: list[RawHost]) -> dict[str, Any]:
    """The cluster-wide variables (executor, Slurm): one value for all hosts, or one BadInput line."""
    declared = [cluster_settings(host, source) for host in hosts]
    result: dict[str, Any] = {}
    for key in CLUSTER_VARS:
        values = {found[key][0] for found in declared if key in found}
        if len(values) > 1 or (values and any(key not in found for found in declared)):
            listing = ", ".join(f"{h.name}={found[key][0] if key in found else '(none)'}"
                                for h, found in zip(hosts, declared, strict=True))
            raise BadInput(f"{source}: {key} differs between hosts ({listing}); it is one setting of the "
                           "whole cluster: set it once in group_vars/all.yml or [all:vars]")
        if values:
            result[key] = values.pop()
    return result


def _check_file(source: Path) -> None:
    if str(source) in ("", "."):
        raise BadInput(f"no inventory file given; give the path of an INI or YAML inventory, e.g. {EXAMPLE}")
    if not source.exists():
        raise BadInput(f"{source}: no such inventory file; give the path of an INI or YAML inventory, "
                       f"e.g. {EXAMPLE}")
    if source.is_dir():
        raise BadInput(f"{source}: is a directory; give one INI or YAML inventory file in it, e.g. {EXAMPLE}")
    # a regular file (a FIFO or device would block or never end) of bounded size, and readable
    text = safeio.read_text(source, "inventory")
    if source.suffix.lower() in YAML_SUFFIXES:
        safeio.check_yaml(text, str(source))


def _check_vars_dirs(source: Path) -> None:
    """ansible reads group_vars/ and host_vars/ beside the inventory: refuse what would block it (a FIFO, a
    device) or expand without bound (YAML aliases) before it looks."""
    for parent in dict.fromkeys((source.parent, source.resolve().parent)):
        for name in ("group_vars", "host_vars"):
            if (parent / name).is_dir():
                safeio.check_vars_tree(parent / name)


def _check_unique_addresses(source: Path, nodes: list[Node]) -> None:
    seen: dict[tuple[str, int], str] = {}
    for node in nodes:
        key = (node.address.lower().rstrip("."), node.ssh.port)
        if key in seen:
            raise BadInput(f"{source}: hosts {seen[key]!r} and {node.name!r} both have address "
                           f"{node.address} port {node.ssh.port}; give each node its own ansible_host "
                           "(or ansible_port)")
        seen[key] = node.name


def _shared_profile(source: Path, declared: list[tuple[str, str | None]]) -> str | None:
    profiles = {name for _, name in declared}
    if len(profiles) <= 1:
        return next(iter(profiles))
    listing = ", ".join(f"{host}={name or '(none)'}" for host, name in declared)
    raise BadInput(f"{source}: stepdeploy_profile differs between nodes ({listing}); all nodes of a "
                   "cluster run one stack profile: set it once in group_vars/all.yml or [all:vars]")


def _printable(message: str) -> str:
    """One printable line whatever bytes the inventory held (host names can be anything): no newlines,
    no terminal escape sequences, no lone surrogates."""
    line = " ".join(message.split())
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    return line.encode("utf-8", "backslashreplace").decode("utf-8")
