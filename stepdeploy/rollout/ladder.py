"""The scaling ladder of a rollout (pure: a cluster and a target model in, rungs out).

The seed's advice made concrete: validate a ~1B proxy first (MoE for an MoE target), on one GPU, then all GPUs of
one node, then all nodes, then the target model on all nodes. A rung the cluster cannot hold, or one that would repeat
the previous rung exactly (a CPU node has one slot), is skipped with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.catalog import load_model
from stepdeploy.inventory.model import Cluster

CPU_PROXY = "tiny-dense"  # CPU nodes (simulated cluster, CI): the torch engine
GPU_PROXY = "proxy-0.7b-dense"  # ~0.7B, the H200 baseline of FACTS
# an MoE target's proxies are MoE too: expert dispatch (router, permutation, expert parallelism) runs at every
# rung before the target's, and the proxy rungs compare like with like
CPU_MOE_PROXY = "tiny-moe"
GPU_MOE_PROXY = "proxy-0.7b-moe"


@dataclass(frozen=True)
class Rung:
    name: str
    model: str
    nodes: int  # the first `nodes` nodes of the inventory
    nproc_per_node: int
    skip_reason: str | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.nproc_per_node

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "nodes": self.nodes, "nproc_per_node": self.nproc_per_node,
                "world": self.world, "skip_reason": self.skip_reason}


def slots_per_node(cluster: Cluster) -> int:
    """Ranks a node runs: its GPUs, or one process on a CPU node."""
    return max(cluster.nodes[0].gpus_per_node or 0, 1)


def proxy_for(cluster: Cluster, target_model: str) -> str:
    """The ladder's proxy: ~0.7B on GPU nodes, tiny on CPU nodes; MoE for an MoE target."""
    moe = load_model(target_model).moe is not None
    if cluster.nodes[0].gpus_per_node:
        return GPU_MOE_PROXY if moe else GPU_PROXY
    return CPU_MOE_PROXY if moe else CPU_PROXY


def scale_ladder(cluster: Cluster, target_model: str, proxy_model: str | None = None) -> list[Rung]:
    slots = slots_per_node(cluster)
    proxy = proxy_model or proxy_for(cluster, target_model)
    n = len(cluster.nodes)
    wanted = [
        Rung("proxy-1-gpu", proxy, 1, 1),
        Rung("proxy-1-node", proxy, 1, slots),
        Rung("proxy-all-nodes", proxy, n, slots),
        Rung("target-all-nodes", target_model, n, slots),
    ]
    rungs: list[Rung] = []
    for rung in wanted:
        same = next((r for r in rungs if not r.skip_reason and (r.model, r.nodes, r.nproc_per_node)
                     == (rung.model, rung.nodes, rung.nproc_per_node)), None)
        if same is not None:
            rung = Rung(rung.name, rung.model, rung.nodes, rung.nproc_per_node,
                        skip_reason=f"same as rung {same.name} on this cluster ({rung.world} rank(s))")
        rungs.append(rung)
    return rungs


def target_rung(cluster: Cluster, target_model: str) -> Rung:
    """What warmup and soak run: the target model on every slot of every node."""
    return Rung("target", target_model, len(cluster.nodes), slots_per_node(cluster))


def sub_cluster(cluster: Cluster, nodes: int) -> Cluster:
    return cluster.model_copy(update={"nodes": cluster.nodes[:nodes]})
