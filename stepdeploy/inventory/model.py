"""The typed cluster an inventory describes: values only, no I/O."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from stepdeploy.executor_kinds import ExecutorKind
from stepdeploy.stack import StackProfile

Connection = Literal["ssh", "local"]
Arch = Literal["x86_64", "aarch64"]
Fabric = Literal["infiniband", "roce", "ethernet"]
SlurmTasks = Literal["node", "gpu"]


class SshSettings(BaseModel):
    """How the controller reaches a node. Paths are as declared; they are not required to exist yet."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str | None = None  # None: ssh's default (the controller's user or ~/.ssh/config)
    port: int = Field(default=22, ge=1, le=65535)
    private_key_file: Path | None = None
    known_hosts_file: Path | None = None
    connection: Connection = "ssh"
    # The inventory variable that turns host-key checking off ('name=value (file:line)'), None when none does.
    unverified_by: str | None = None
    # Whether stepdeploy verifies the host key: always, unless the user accepted `unverified_by` (--insecure).
    host_key_checking: bool = True
    proxy_jump: str | None = None  # [user@]host[:port][,...] from -J / -o ProxyJump= in ansible's ssh args


class Node(BaseModel):
    """One host of the inventory. Hardware fields are declared expectations; preflight replaces them
    with discovered facts. None means the inventory does not say."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    address: str
    groups: list[str] = []
    ssh: SshSettings = SshSettings()
    gpus_per_node: int | None = Field(default=None, ge=0)
    gpu_model: str | None = None
    arch: Arch | None = None
    train_iface: str | None = None  # netdev for NCCL_SOCKET_IFNAME
    fabric: Fabric | None = None
    ib_hcas: list[str] = []  # NCCL_IB_HCA; for RoCE on a DGX Spark both halves of the port
    ib_rate_gbit: int | None = Field(default=None, ge=1)  # one HCA port's rate, Gb/s (ibstat); None: the fabric's


class SlurmSettings(BaseModel):
    """How runs go through Slurm (inventory `stepdeploy_slurm_*`); used when the executor is slurm."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    controller: str | None = None  # where sbatch/squeue/scancel run: a node's name or a host; None: the first node
    partition: str | None = None  # None: the cluster's default partition
    tasks: SlurmTasks = "node"  # one task per node (running launch.sh) or one task per GPU


class Cluster(BaseModel):
    """All nodes of one inventory and the one stack profile they share."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Path
    nodes: list[Node]
    profile: StackProfile | None = None  # None: the inventory names no stepdeploy_profile
    warnings: list[str] = []  # ansible warnings that did not stop parsing (e.g. odd group names)
    executor: ExecutorKind | None = None  # inventory stepdeploy_executor; None: fabric (SSH)
    slurm: SlurmSettings = SlurmSettings()

    def unverified(self) -> list[Node]:
        """The nodes whose inventory variables turn SSH host-key checking off."""
        return [node for node in self.nodes if node.ssh.unverified_by is not None]

    def node(self, name: str) -> Node:
        """The node called `name` (KeyError if there is none)."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)
