"""Fabric connections with host-key verification on, on every hop.

Fabric's Connection installs paramiko's AutoAddPolicy (silently trusting any host key), also on the jump
connections it builds itself for a ProxyJump in ~/.ssh/config; every connection made here, jump hosts
included, instead loads the cluster's known_hosts file and rejects unknown or changed keys. Only a node whose
inventory turns checking off, accepted with --insecure (SshSettings.host_key_checking False), takes unknown
keys; a key that contradicts known_hosts is refused even then.
"""

from __future__ import annotations

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
    user: str | None = None  # None: what ssh itself uses (~/.ssh/config's User for the host, else our user name)
    port: int = 22
    key_file: Path | None = None
    known_hosts: Path | None = None
    proxy_jump: str | None = None  # [user@]host[:port][,...]: jump hosts, each verified like the node
    verify: bool = True  # False only for a node the user accepted unverified (--insecure)


def connection(ep: Endpoint, *, connect_timeout: int = 10) -> Connection:
    from fabric import Config, Connection

    # Every phase of connecting is bounded, not only the TCP connect: paramiko's defaults wait 15 s for the banner,
    # 30 s for authentication and an hour for a session to open (transport.SshChannel bounds each operation whole).
    kwargs: dict = {"look_for_keys": ep.key_file is None, "allow_agent": ep.key_file is None,
                    "banner_timeout": connect_timeout, "auth_timeout": connect_timeout,
                    "channel_timeout": connect_timeout}
    if ep.key_file is not None:
        kwargs["key_filename"] = str(ep.key_file)
    # Nothing here is interactive: never forward our stdin (it may be a terminal, a pipe or closed).
    config = Config(overrides={"run": {"in_stream": False}, "sudo": {"in_stream": False}})
    gateway = _jump_chain(ep.proxy_jump, config, kwargs, connect_timeout) if ep.proxy_jump else None
    conn = Connection(ep.host, user=ep.user, port=ep.port, connect_timeout=connect_timeout,
                      connect_kwargs=kwargs, config=config, gateway=gateway)
    verify_host_keys(conn, ep.known_hosts, verify=ep.verify)
    return conn


def _jump_chain(proxy_jump: str, config: object, kwargs: dict, connect_timeout: int) -> Connection:
    """Fabric's own reading of `ProxyJump a,b`: the last hop is reached through the earlier ones."""
    from fabric import Connection

    gateway = None
    for hop in proxy_jump.split(","):
        gateway = Connection(hop.strip(), config=config.clone(), connect_timeout=connect_timeout,  # type: ignore[attr-defined]
                             connect_kwargs=dict(kwargs), gateway=gateway)
    return gateway


def verify_host_keys(conn: Connection, known_hosts: Path | None, *, verify: bool = True) -> None:
    """Replace Fabric's AutoAddPolicy on the connection and on every jump connection behind it (Fabric
    builds those for a ProxyJump in ~/.ssh/config with AutoAddPolicy again): only keys in `known_hosts` (or
    the user's own) are accepted."""
    from fabric import Connection
    from paramiko import AutoAddPolicy, RejectPolicy

    hop: object = conn
    while isinstance(hop, Connection):
        hop.client.set_missing_host_key_policy(RejectPolicy() if verify else AutoAddPolicy())
        if known_hosts is not None:
            hop.client.load_host_keys(str(known_hosts))
        else:
            hop.client.load_system_host_keys()
        hop = hop.gateway


def group(endpoints: Iterable[Endpoint], *, connect_timeout: int = 10) -> ThreadingGroup:
    """A Fabric ThreadingGroup whose members all verify host keys."""
    from fabric import ThreadingGroup

    return ThreadingGroup.from_connections([connection(ep, connect_timeout=connect_timeout)
                                            for ep in endpoints])


def endpoint_for(node: Node) -> Endpoint:
    """How to reach an inventory node: its address, SSH user, port, key and known_hosts. The user is the
    inventory's ansible_user, else what ssh and Ansible themselves use (~/.ssh/config's User for the host, else
    the local user name): preflight, the monitors and every executor reach a node as the same user."""
    ssh = node.ssh
    return Endpoint(host=node.address, user=ssh.user, port=ssh.port,
                    key_file=ssh.private_key_file, known_hosts=ssh.known_hosts_file, proxy_jump=ssh.proxy_jump,
                    verify=ssh.host_key_checking)
