"""The environment of one node's ranks: NCCL/gloo from the node's facts, torch's error handling, allocator
settings, the seed's options (with what they really do), and the user's extra variables. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.inventory.model import Node
from stepdeploy.plan.layout import Layout
from stepdeploy.render.options import SEED_OPTIONS, RenderOptions

IB_TIMEOUT = 20  # 4.096 us x 2^20 = 4.3 s per retry; with 7 retries ~34 s before a queue pair errors
IB_RETRY_CNT = 7


@dataclass(frozen=True)
class EnvVar:
    key: str
    value: str
    why: tuple[str, ...] = ()
    # an arithmetic expansion the node's shell evaluates, "$(( ... ))" built here from integers only: rendered in
    # double quotes, not single
    arithmetic: bool = False


@dataclass(frozen=True)
class NodeFacts:
    """What provisioning discovered on a node and the renderer uses (None/empty: not discovered).

    `ib_hcas` holds one "dev:port" per selected port, so both halves of a split ConnectX-7 port are two
    entries; `source` and `sha256` name the facts file they came from (stepdeploy.render.facts)."""

    gid_index: int | None = None
    socket_ifname: str | None = None
    ib_hcas: tuple[str, ...] = ()
    gid_indexes: tuple[int, ...] = ()  # every port's RoCE v2 GID index (several: none could be chosen)
    source: str | None = None
    sha256: str | None = None

    def found(self, what: str) -> str:
        where = f" ({self.source})" if self.source else ""
        return f"{what} found by provisioning{where}"


def node_environment(node: Node, node_rank: int, layout: Layout, opts: RenderOptions,
                     facts: NodeFacts | None = None) -> tuple[list[EnvVar], list[str]]:
    """(variables in render order, notes for the user) for `node`."""
    facts = facts or NodeFacts()
    notes: list[str] = []
    env = _identity(node, node_rank, opts)
    env += _network(node, facts, notes)
    env += _torch(node, layout, opts)
    env += _seed(opts, notes)
    env += [EnvVar(key, value, ("given with --env",)) for key, value in opts.extra_env]
    return _last_wins(env), notes


def _identity(node: Node, node_rank: int, opts: RenderOptions) -> list[EnvVar]:
    why = ("the run's identity; stop and poll find this run's processes by STEPDEPLOY_RUN_ID",)
    return [
        EnvVar("STEPDEPLOY_RUN_ID", opts.run_id, why),
        EnvVar("STEPDEPLOY_RUN_DIR", opts.run_dir),
        EnvVar("STEPDEPLOY_NODE_NAME", node.name),
        EnvVar("STEPDEPLOY_NODE_RANK", str(node_rank)),
        EnvVar("PYTHONUNBUFFERED", "1", ("log lines reach the log file as they are printed",)),
    ]


def _network(node: Node, facts: NodeFacts, notes: list[str]) -> list[EnvVar]:
    env: list[EnvVar] = []
    iface = facts.socket_ifname or node.train_iface
    if facts.socket_ifname:
        why: tuple[str, ...] = (facts.found(f"training netdev up on {node.name}"),)
        if node.train_iface and node.train_iface != facts.socket_ifname:
            notes.append(f"{node.name}: inventory says stepdeploy_train_iface={node.train_iface} but provisioning "
                         f"found {facts.socket_ifname} up; rendering {facts.socket_ifname}")
    else:
        why = (f"training interface of {node.name} (inventory stepdeploy_train_iface)",)
    if iface:
        ucx = ",".join(facts.ib_hcas) if facts.ib_hcas and node.fabric in ("infiniband", "roce") else iface
        env += [EnvVar("NCCL_SOCKET_IFNAME", iface, why), EnvVar("GLOO_SOCKET_IFNAME", iface),
                EnvVar("UCX_NET_DEVICES", ucx), EnvVar("OMPI_MCA_btl_tcp_if_include", iface)]
    else:
        notes.append(f"{node.name}: no stepdeploy_train_iface; NCCL and gloo pick an interface themselves")
    if node.fabric in ("infiniband", "roce"):
        env += _rdma(node, facts, notes)
    elif node.fabric == "ethernet" or node.fabric is None:
        env.append(EnvVar("NCCL_IB_DISABLE", "1", ("no RDMA fabric declared: NCCL uses sockets",)))
    return env


def _rdma(node: Node, facts: NodeFacts, notes: list[str]) -> list[EnvVar]:
    env: list[EnvVar] = []
    # '=' makes NCCL match names exactly (mlx5_1 would otherwise also select mlx5_10 ...).
    if facts.ib_hcas:
        env.append(EnvVar("NCCL_IB_HCA", "=" + ",".join(facts.ib_hcas),
                          (facts.found("RDMA ports (device:port)"), "exact match; every selected port is listed, "
                           "so both halves of a split port (DGX Spark) are")))
        declared = {h.split(":")[0] for h in node.ib_hcas}
        if declared and declared != {h.split(":")[0] for h in facts.ib_hcas}:
            notes.append(f"{node.name}: inventory stepdeploy_ib_hcas {','.join(node.ib_hcas)} differ from the "
                         f"ports provisioning found ({','.join(facts.ib_hcas)}); rendering what was found")
    elif node.ib_hcas:
        env.append(EnvVar("NCCL_IB_HCA", "=" + ",".join(node.ib_hcas),
                          ("RDMA devices of the inventory, exact match; on a DGX Spark both halves of the port",)))
    else:
        notes.append(f"{node.name}: fabric {node.fabric} but no stepdeploy_ib_hcas; NCCL uses every HCA it finds")
    if facts.source and not facts.ib_hcas:
        notes.append(f"{node.name}: fabric {node.fabric} but provisioning found no RDMA port ({facts.source})")
    env += [
        EnvVar("NCCL_IB_TIMEOUT", str(IB_TIMEOUT), ("4.096 us x 2^20 = 4.3 s per retry",)),
        EnvVar("NCCL_IB_RETRY_CNT", str(IB_RETRY_CNT),
               ("retries before a queue pair errors (~34 s in all at NCCL_IB_TIMEOUT 20)",)),
    ]
    if node.fabric == "roce":
        if facts.gid_index is not None:
            env.append(EnvVar("NCCL_IB_GID_INDEX", str(facts.gid_index), (facts.found("RoCE v2 GID index"),)))
        elif len(facts.gid_indexes) > 1:
            notes.append(f"{node.name}: its ports have different RoCE v2 GID indexes "
                         f"({', '.join(map(str, facts.gid_indexes))}) and NCCL_IB_GID_INDEX is one value; "
                         "set infiniband_gid_index for the node and provision again")
        else:
            notes.append(f"{node.name}: RoCE GID index not discovered (stepdeploy provision saves it); "
                         "NCCL_IB_GID_INDEX left to NCCL's own choice rather than hard-coding 3")
    return env


def _torch(node: Node, layout: Layout, opts: RenderOptions) -> list[EnvVar]:
    cache = f"{opts.remote_dir.rstrip('/')}/.compile-cache"
    env = [EnvVar("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3",
                  ("a failed or timed-out collective tears the process down instead of hanging",)),
           EnvVar("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(opts.heartbeat_timeout_s),
                  ("torch's NCCL watchdog: kill a rank whose collectives made no progress for this long",)),
           EnvVar("TORCHINDUCTOR_CACHE_DIR", f"{cache}/inductor",
                  ("torch.compile's caches beside the runs, not /tmp/torchinductor_<user> (world-writable, a",
                   "predictable name), shared by the runs on this node: a restart, and every stage after the",
                   "first, reuse the kernels compiled before (on an H200 a warm cache cut the dense proxy's",
                   "first step from 14.0 s to 5.3 s: docs/benchmarks.md)")),
           EnvVar("TRITON_CACHE_DIR", f"{cache}/triton"),
           EnvVar("THP_MEM_ALLOC_ENABLE", "1",
                  ("torch's CPU allocator asks for transparent huge pages for blocks of 2 MiB and more: a",
                   "checkpoint read, which fills fresh host memory twice per tensor, page-faults 512x less (a",
                   "2 GiB torch DCP read 2.4-2.7 s -> 1.2-1.3 s on a CPU: docs/benchmarks.md)"))]
    gpus = node.gpus_per_node or 0
    if gpus:
        env.append(EnvVar("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True",
                          ("fewer fragmentation OOMs with changing shapes (MoE routing)",)))
        env.append(EnvVar("TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK", "0",
                          ("inductor's load-time halving of a reduction kernel's block adds a second config that is",
                           "benchmarked again at every process start, warm cache or not (pytorch/pytorch#189121):",
                           "on an H200 the dense proxy's first step after a restart 5.78 s -> 2.75 s, kill to first",
                           "new step 21.0 -> 17.7 s, the steady step unchanged (0.626/0.627 s): docs/benchmarks.md")))
        if layout.optimizer_cpu_offload and gpus > 1:
            env.append(EnvVar("OMP_NUM_THREADS", f"$(( $(nproc) / {gpus} > 1 ? $(nproc) / {gpus} : 1 ))",
                              ("optimizer CPU offload: each rank's AdamW runs on the host with this many threads, the",
                               "node's CPUs shared by its GPUs (torchrun would set 1 for more than one rank per",
                               "node; the plan's host rate, 45 GB/s, was measured with one rank on 16 cores)"),
                              arithmetic=True))
        if layout.tp > 1 or layout.cp > 1:
            env.append(EnvVar("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                              ("one hardware queue keeps TP/sequence-parallel comm ordered ahead of compute",)))
    else:
        threads = opts.threads_per_rank or 1
        env.append(EnvVar("OMP_NUM_THREADS", str(threads), ("CPU node: threads per rank",)))
    if opts.disable_nvls:
        why = ("NVLink multicast off (inventory/--no-nvls): a program using it can take shared GPUs down",)
        env += [EnvVar("NCCL_NVLS_ENABLE", "0", why), EnvVar("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                EnvVar("NVSHMEM_DISABLE_NVLS", "1")]
    return env


def _seed(opts: RenderOptions, notes: list[str]) -> list[EnvVar]:
    env: list[EnvVar] = []
    for name in opts.seed_options:
        renders, truth = SEED_OPTIONS[name]
        notes.append(f"seed option {name} ({renders}): {truth}")
        why = (f"seed option {name}: {truth}",)
        if name == "nccl-algo-tree":
            env.append(EnvVar("NCCL_ALGO", "Tree", why))
        elif name == "cuda-malloc-async":
            env.append(EnvVar("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", why))
        elif name == "ib-timeout-22":
            env.append(EnvVar("NCCL_IB_TIMEOUT", "22", why))
    return env


def _last_wins(env: list[EnvVar]) -> list[EnvVar]:
    """A later variable of the same name replaces an earlier one, at the earlier one's place."""
    order: dict[str, EnvVar] = {}
    for var in env:
        order[var.key] = var
    return list(order.values())
