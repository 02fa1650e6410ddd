"""Ansible inventory -> typed Cluster (nodes, addresses, SSH settings, declared hardware, stack profile)."""

from stepdeploy.inventory.loader import load_cluster
from stepdeploy.inventory.model import Arch, Cluster, Connection, Fabric, Node, SshSettings
from stepdeploy.inventory.nodes import STEPDEPLOY_VARS

__all__ = [
    "STEPDEPLOY_VARS", "Arch", "Cluster", "Connection", "Fabric", "Node", "SshSettings", "load_cluster",
]
