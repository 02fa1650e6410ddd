"""Fabric connections with host-key verification on.

Fabric's Connection installs paramiko's AutoAddPolicy (silently trusting any host key); every connection
made here instead loads the cluster's known_hosts file and rejects unknown or changed keys.
"""

from __future__ import annotations

import getpass
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stepdeploy.inventory.model import Node

if TYPE_CHECKING:  # Fabric/paramiko take ~0.5 s to import: loaded when a connection is made
    from fabric import Connection, ThreadingGroup


@dataclass(frozen=True)
class Endpoint:
    """Where and how to reach one node (no secrets: the key is a path, read lazily by paramiko)."""

    host: str
    user: str = "root"
    port: int = 22
    key_file: Path | None = None
    known_hosts: Path | None = None


def connection(ep: Endpoint, *, connect_timeout: int = 10) -> Connection:
    from fabric import Config, Connection

    kwargs: dict = {"look_for_keys": ep.key_file is None, "allow_agent": ep.key_file is None}
    if ep.key_file is not None:
        kwargs["key_filename"] = str(ep.key_file)
    # Nothing here is interactive: never forward our stdin (it may be a terminal, a pipe or closed).
    config = Config(overrides={"run": {"in_stream": False}, "sudo": {"in_stream": False}})
    conn = Connection(ep.host, user=ep.user, port=ep.port, connect_timeout=connect_timeout,
                      connect_kwargs=kwargs, config=config)
    verify_host_keys(conn, ep.known_hosts)
    return conn


def verify_host_keys(conn: Connection, known_hosts: Path | None) -> None:
    """Replace Fabric's AutoAddPolicy: only keys in `known_hosts` (or the user's own) are accepted."""
    from paramiko import RejectPolicy

    conn.client.set_missing_host_key_policy(RejectPolicy())
    if known_hosts is not None:
        conn.client.load_host_keys(str(known_hosts))
    else:
        conn.client.load_system_host_keys()


def group(endpoints: Iterable[Endpoint], *, connect_timeout: int = 10) -> ThreadingGroup:
    """A Fabric ThreadingGroup whose members all verify host keys."""
    from fabric import ThreadingGroup

    return ThreadingGroup.from_connections([connection(ep, connect_timeout=connect_timeout)
                                            for ep in endpoints])



def endpoint_for(node: Node) -> Endpoint:
    """How to reach an inventory node: its address, SSH user (default: ours), port, key and known_hosts."""
    ssh = node.ssh
    return Endpoint(host=node.address, user=ssh.user or getpass.getuser(), port=ssh.port,
                    key_file=ssh.private_key_file, known_hosts=ssh.known_hosts_file)
