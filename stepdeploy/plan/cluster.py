"""The cluster as the planner sees it: N identical nodes of G GPUs joined by one inter-node link (and, where the
inventory says, that link's HCAs per node and their rate)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from stepdeploy.catalog import GpuSpec, LinkSpec, gpu, link, load_hardware
from stepdeploy.errors import BadInput
from stepdeploy.inventory.values import MAX_GPUS_PER_NODE

# Far beyond any cluster built so far; the search does not loop per node or GPU, this only bounds the input.
MAX_NODES = 100_000


@dataclass(frozen=True)
class ClusterShape:
    nodes: int
    gpus_per_node: int
    gpu: GpuSpec
    inter_node_link: LinkSpec
    hcas_per_node: int | None = None  # the inventory's stepdeploy_ib_hcas, counted; None: the link's own assumption
    hca_rate_gbit: int | None = None  # the inventory's stepdeploy_ib_rate; None: the link's rate (hardware.yaml)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> ClusterShape:
        return replace(self, nodes=nodes)

    def without_hcas(self) -> ClusterShape:
        return replace(self, hcas_per_node=None, hca_rate_gbit=None)

    @property
    def link_rate_gbit(self) -> float:
        """One HCA's rate, Gb/s: the inventory's, else the catalog link's (its bandwidth_gbps is GB/s)."""
        return self.hca_rate_gbit or self.inter_node_link.bandwidth_gbps * 8

    def describe(self) -> str:
        hcas = ""
        if self.hcas_per_node or self.hca_rate_gbit:
            count = f"{self.hcas_per_node} x " if self.hcas_per_node else ""
            hcas = f" ({count}{self.link_rate_gbit:g} Gb/s HCA{'s' if (self.hcas_per_node or 1) > 1 else ''} per node)"
        return (
            f"{self.nodes} node(s) x {self.gpus_per_node} {self.gpu.name} = {self.world} GPUs, "
            f"{self.inter_node_link.name} between nodes{hcas}"
        )

    def group_busbw_gbps(self, span: int) -> float:
        """Bus bandwidth per GPU of a collective whose ranks lie within `span` consecutive ranks."""
        if span <= self.gpus_per_node and self.gpus_per_node > 1 and self.gpu.intra_node_link:
            return link(self.gpu.intra_node_link).busbw_gbps
        return self.inter_node_busbw_gbps()

    def inter_node_busbw_gbps(self) -> float:
        """Bus bandwidth per GPU between nodes. A per-GPU link's figure (ib-400g) is one HCA per GPU, as on a
        DGX H100: the inventory's HCA count shares the node's HCAs over its GPUs instead (4 HCAs for 8 GPUs: half
        each; more HCAs than GPUs are not counted, a GPU drives one). A per-node link's figure (roce-200g: a DGX
        Spark's port, both halves of it, which the inventory lists as two HCAs) is the node's whatever the count.
        Either scales with the inventory's HCA rate against the link's."""
        inter = self.inter_node_link
        node_or_nic = inter.busbw_gbps * self.link_rate_gbit / (inter.bandwidth_gbps * 8)
        if not inter.per_gpu:
            return node_or_nic / self.gpus_per_node
        nics = min(self.hcas_per_node or self.gpus_per_node, self.gpus_per_node)
        return node_or_nic * nics / self.gpus_per_node


def cluster_shape(nodes: int, gpus_per_node: int, gpu_name: str, link_name: str) -> ClusterShape:
    if nodes < 1 or gpus_per_node < 1:
        raise BadInput(f"need at least one node and one GPU per node (got {nodes} x {gpus_per_node})")
    if nodes > MAX_NODES or gpus_per_node > MAX_GPUS_PER_NODE:
        raise BadInput(f"{nodes} node(s) x {gpus_per_node} GPUs is beyond what the planner takes (at most "
                       f"{MAX_NODES:,} nodes of at most {MAX_GPUS_PER_NODE} GPUs)")
    return ClusterShape(nodes, gpus_per_node, gpu(gpu_name), link(link_name))


def _one_value(values: list[Any], what: str) -> Any:
    counts = Counter(values)
    if len(counts) != 1:
        found = ", ".join(f"{value} x{count}" for value, count in counts.most_common())
        raise BadInput(f"the planner needs identical nodes; {what} differs across nodes: {found}")
    return values[0]


def shape_from_cluster(cluster: Any) -> ClusterShape:
    """Build the planner's view from an inventory Cluster (duck-typed: .nodes[*].gpus_per_node,
    .gpu_model, .fabric)."""
    nodes = list(getattr(cluster, "nodes", []))
    if not nodes:
        raise BadInput("the inventory lists no nodes")
    gpu_model = _one_value([node.gpu_model for node in nodes], "GPU model")
    if not gpu_model:
        raise BadInput(
            "the inventory does not say which GPU the nodes have",
            hint="set gpu_model in group_vars, or pass --gpu H100|H200|B200|GB10",
        )
    per_node = _one_value([node.gpus_per_node for node in nodes], "GPUs per node")
    if not per_node:
        raise BadInput(f"the inventory names the GPU ({gpu_model}) but not how many each node has",
                       hint="set stepdeploy_gpus_per_node in group_vars, or pass --gpus-per-node")
    fabric = _one_value([node.fabric for node in nodes], "fabric")
    fabric_links = load_hardware().fabric_links
    if fabric not in fabric_links:
        raise BadInput(f"unknown fabric {fabric!r}; known: {', '.join(sorted(fabric_links))}")
    shape = cluster_shape(len(nodes), per_node, gpu_model, fabric_links[fabric])
    if shape.inter_node_link.kind not in ("infiniband", "roce"):
        return shape  # HCAs are RDMA devices: none carry an ethernet fabric's traffic
    rate = _one_value([getattr(node, "ib_rate_gbit", None) for node in nodes], "the HCA rate (stepdeploy_ib_rate)")
    if not shape.inter_node_link.per_gpu:  # a per-node figure: HCAs counted would count a split port's halves
        return replace(shape, hca_rate_gbit=rate)
    hcas = _one_value([len(getattr(node, "ib_hcas", [])) for node in nodes], "the HCA count (stepdeploy_ib_hcas)")
    return replace(shape, hcas_per_node=hcas or None, hca_rate_gbit=rate)
