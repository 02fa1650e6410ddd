"""The local executor: a rendered run driven on this machine, without SSH -- a single GPU box, or an inventory
whose hosts are all ansible_connection=local. The same shell steps as over SSH (node_executor.py), run by a
local channel: the upload is atomic and checked, the run is started `setsid nohup` in a session of its own (it
outlives the controller), poll and stop read /proc with node_probe.py, stop kills the run's process group and
every process carrying its STEPDEPLOY_RUN_ID and proves none is left, fetch packs into a fresh private
directory (mktemp -d, 0700).

The run gets the environment an SSH login would give it (transport.session_environment): PATH, HOME, locale,
and this box's GPU and collective settings (CUDA_VISIBLE_DEVICES, NCCL_*, ...); not the controller's
PYTHONPATH or virtualenv. Its run directory is the manifest's run_dir (render --remote-dir; default
/var/lib/stepdeploy/runs/<run id>), whose parent must not be writable by every user.
"""

from __future__ import annotations

import sys
from pathlib import Path

from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Cluster
from stepdeploy.remote.executor import EventSink
from stepdeploy.remote.node_executor import NodeExecutor, targets_from
from stepdeploy.remote.transport import Channel, LocalChannel, is_local, session_environment
from stepdeploy.render.manifest import Manifest


class LocalExecutor(NodeExecutor):
    kind = "local"
    python = sys.executable  # the controller's own interpreter runs node_probe.py (isolated: python -I)
    one_machine = True
    # a poll here is two local processes (node_probe.py, a tail), not SSH round trips: a rollout polls 4x as often
    # as over SSH, and sees a dead rank within half a second (on an H200, 2.1-2.2 s at 2 s)
    poll_interval_s = 0.5


def create(manifest: Manifest, cluster: Cluster, local_run: Path, on_event: EventSink) -> LocalExecutor:
    """The local executor of a rendered run. A run of several nodes runs here only when the inventory says
    every one of them is this machine (ansible_connection=local): their ranks would look for each other at
    the other hosts' addresses otherwise."""
    del local_run, on_event
    names = manifest.node_names
    by_name = {node.name: node for node in cluster.nodes}
    elsewhere = [n for n in names if n in by_name and not is_local(by_name[n])]
    if len(names) > 1 and elsewhere:
        raise BadInput(f"the local executor runs every node on this machine, but the run has {len(names)} nodes and "
                       f"the inventory reaches {', '.join(elsewhere)} over SSH",
                       hint="use --executor fabric, or an inventory whose hosts are all ansible_connection=local")
    env = session_environment()
    channels: dict[str, Channel] = {name: LocalChannel(name, env=env) for name in names}
    return LocalExecutor(manifest.run_id, manifest.run_dir, targets_from(manifest, channels))


__all__ = ["LocalExecutor", "create"]
