"""The fabric executor: a rendered run driven over SSH (Fabric, host keys verified), one channel per node, all
nodes in parallel (node_executor.py does the work; this module only says how the nodes are reached).

A node the inventory marks ansible_connection=local is this machine: reached without SSH, as preflight does.
"""

from __future__ import annotations

from pathlib import Path

from stepdeploy.inventory.model import Cluster
from stepdeploy.remote.executor import EventSink, Target
from stepdeploy.remote.node_executor import NodeExecutor, targets_from
from stepdeploy.remote.transport import channel_for, session_environment
from stepdeploy.render.manifest import Manifest


class FabricExecutor(NodeExecutor):
    kind = "fabric"


def create(manifest: Manifest, cluster: Cluster, local_run: Path, on_event: EventSink) -> FabricExecutor:
    """The executor of a rendered run, reaching its nodes as the inventory says (KeyError: a node the
    inventory lacks). It records no events."""
    del local_run, on_event
    env = session_environment()
    channels = {node.name: channel_for(node, env=env) for node in cluster.nodes}
    return FabricExecutor(manifest.run_id, manifest.run_dir, targets_from(manifest, channels))


__all__ = ["FabricExecutor", "Target", "create"]
