"""preflight end to end: probe every node, judge each, then the cross-node checks and the bandwidth sweep."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stepdeploy import compat
from stepdeploy.catalog.hardware import Hardware
from stepdeploy.catalog.loader import load_hardware
from stepdeploy.inventory.model import Node, SshSettings
from stepdeploy.preflight import bandwidth, cluster, collect, gpu, host, probe
from stepdeploy.preflight.model import NodeOutput, Report, Result, Status, fail, skip
from stepdeploy.remote import transport
from stepdeploy.stack import StackProfile

Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
    return None


@dataclass(frozen=True)
class Options:
    local: bool = False
    checkpoint_dir: str = "/"
    min_free_gib: float = 50.0
    disk_why: str | None = None  # where min_free_gib comes from (the checkpoints a run keeps: cli/preflight.py)
    min_shm_gib: float = 1.0
    timeout_s: float = 60.0
    clock_bound_s: float = cluster.CLOCK_SKEW_BOUND_S
    bandwidth: bool = True
    sizes: str | None = None
    iters: int = 20
    master_port: int = 29533
    python: str | None = None  # the training environment's interpreter on the nodes; None: probe's defaults
    needs: tuple[str, ...] = ()  # what the run's layout needs on every node (plan/engines.needs; cli/preflight.py)


def this_machine() -> Node:
    return Node(name=socket.gethostname(), address="127.0.0.1", ssh=SshSettings(connection="local"))


def catalog_gpu(hardware: Hardware, product_name: str) -> str | None:
    """The hardware catalog's key for an nvidia-smi product name ('NVIDIA H200' -> 'H200')."""
    keys = [k for k in hardware.gpus if k.lower() in product_name.lower().split() or
            f" {k.lower()}" in f" {product_name.lower()}"]
    return max(keys, key=len) if keys else None


def expect_for(node: Node, profile: StackProfile | None, opts: Options) -> host.Expect:
    return host.Expect(gpus=node.gpus_per_node, gpu_model=node.gpu_model, arch=node.arch, fabric=node.fabric,
                       train_iface=node.train_iface, ib_hcas=tuple(node.ib_hcas), profile=profile,
                       min_free_gib=opts.min_free_gib, min_shm_gib=opts.min_shm_gib,
                       checkpoint_dir=opts.checkpoint_dir, disk_why=opts.disk_why,
                       needs=opts.needs)


def node_results(out: NodeOutput, exp: host.Expect, hardware: Hardware) -> list[Result]:
    """Every per-node check over what the probe collected. Pure."""
    s = out.get
    inv = gpu.inventory(s("nvidia_smi"))
    model = catalog_gpu(hardware, inv.gpus[0].name) if isinstance(inv, gpu.GpuInventory) and inv.gpus else None
    spec = hardware.gpus.get(model or "")
    has_gpus = isinstance(inv, gpu.GpuInventory) and bool(inv.gpus)
    profile = exp.profile
    results = [
        host.check_os(s("uname"), s("os_release")),
        host.check_arch(s("uname"), exp.arch),
        gpu.check_gpus(inv, exp.gpus, exp.gpu_model, spec.memory_mib if spec else None),
        gpu.check_driver(inv, profile.driver if profile else None),
        gpu.check_cuda(inv, profile.cuda if profile else None),
        gpu.check_persistence(inv),
        gpu.check_ecc(inv),
        gpu.check_remap(inv),
        gpu.check_xid(s("kernel_log"), has_gpus),
        gpu.check_topology(s("nvidia_topo"), inv, bool(spec and spec.intra_node_link)),
        host.check_nccl(s("nccl_pkg"), s("python"), exp),
        host.check_python(s("python"), exp),
        host.check_torch(s("python"), exp),
        host.check_megatron(s("python"), exp),
        host.check_flash_attn(s("python"), exp),
        host.check_transformer_engine(s("python"), exp),
        host.check_ib(s("ib_ports"), exp),
        host.check_peermem(s("modules"), exp),
        host.check_iface(s("iface"), exp),
        host.check_memlock(s("memlock"), exp.fabric),
        host.check_shm(s("shm"), exp.min_shm_gib),
        host.check_disk(s("disk"), exp.min_free_gib, exp.checkpoint_dir, exp.disk_why),
    ]
    return [r.on(out.node) for r in results]


def versions_of(out: NodeOutput) -> dict[str, str | None]:
    inv = gpu.inventory(out.get("nvidia_smi"))
    env = host.python_env(out.get("python")) or {}
    package, bundled = host.nccl_versions(out.get("nccl_pkg"), out.get("python"))
    versions = {"python": env.get("python"), "torch": env.get("torch"), "libnccl2": package,
                "torch NCCL": bundled, "megatron-core": env.get("megatron_core"), "flash-attn": env.get("flash_attn"),
                "transformer-engine": env.get("transformer_engine")}
    if isinstance(inv, gpu.GpuInventory):
        versions |= {"driver": inv.driver, "CUDA (driver)": inv.cuda}
    return versions


def host_facts(out: NodeOutput, node: Node) -> compat.HostFacts:
    inv = gpu.inventory(out.get("nvidia_smi"))
    if isinstance(inv, gpu.GpuInventory):
        gpus = tuple(compat.GpuModel(name=g.name) for g in inv.gpus)
        return compat.HostFacts(host=node.name, arch=host.arch_of(out.get("uname")), gpus=gpus)
    declared = tuple(compat.GpuModel(name=node.gpu_model) for _ in range(node.gpus_per_node or 0)) \
        if node.gpu_model else ()
    return compat.HostFacts(host=node.name, arch=host.arch_of(out.get("uname")), gpus=declared,
                            gpu_source="declared in the inventory")


def run(nodes: Sequence[Node], profile: StackProfile | None, opts: Options, *,
        progress: Progress = _quiet, now: Callable[[], float] = time.time) -> Report:
    started = time.monotonic()
    hardware = load_hardware()
    by_name = {n.name: n for n in nodes}
    targets = {n.name: transport.channel_for(n, local=opts.local) for n in nodes}
    pythons = (opts.python,) if opts.python else probe.DEFAULT_PYTHONS
    specs = {n.name: probe.PreflightProbeSpec(train_iface=n.train_iface, checkpoint_dir=opts.checkpoint_dir,
                                     pythons=pythons, section_timeout_s=int(max(5, opts.timeout_s - 5)))
             for n in nodes}
    try:
        progress(f"probing {len(nodes)} node(s) (timeout {opts.timeout_s:g} s each)")
        outputs = collect.probe_all(list(targets.values()), specs, opts.timeout_s, now)
        report = Report(nodes=[n.name for n in nodes], results=[])
        report.unreachable = {name: o.error for name, o in outputs.items() if o.error}
        alive = [outputs[n.name] for n in nodes if not outputs[n.name].error]
        for out in alive:
            report.results += node_results(out, expect_for(by_name[out.node], profile, opts), hardware)
        for name, why in report.unreachable.items():
            report.results.append(fail("reach_node", why, "the node answers over SSH within the timeout",
                                       "check the node is up, sshd runs, and the address/key/known_hosts "
                                       "in the inventory").on(name))
        report.results += _cross_node(alive, by_name, profile, opts, targets, report, hardware, progress)
    finally:
        for t in targets.values():
            t.close()
    report.seconds = time.monotonic() - started
    return report


def _train_address(out: NodeOutput, node: Node) -> str:
    return host.iface_facts(out.get("iface"))[1] or node.address


def _cross_node(alive: list[NodeOutput], by_name: dict[str, Node], profile: StackProfile | None, opts: Options,
                targets: dict[str, transport.Channel], report: Report, hardware: Hardware,
                progress: Progress) -> list[Result]:
    results = [
        cluster.check_same_versions({o.node: versions_of(o) for o in alive}),
        cluster.check_clock({o.node: (o.clock_skew_s, o.clock_uncertainty_s or 0.0) for o in alive
                             if o.clock_skew_s is not None}, opts.clock_bound_s),
        cluster.check_compat(profile, [host_facts(o, by_name[o.node]) for o in alive]),
    ]
    partial = cluster.warn_if_partial(len(alive), len(by_name))
    if partial:
        results.append(partial)
    live_targets = [targets[o.node] for o in alive]
    reach = skip("reachability", "one node")
    if len(alive) > 1:
        progress("checking that every node reaches every other on the training network")
        addresses = {o.node: (_train_address(o, by_name[o.node]), by_name[o.node].ssh.port) for o in alive}
        reach = cluster.check_reachability(collect.reach_all(live_targets, addresses, 15), len(alive))
    results.append(reach)
    results.append(_bandwidth(alive, by_name, opts, live_targets, reach, report, hardware, progress))
    return results


def _bandwidth(alive: list[NodeOutput], by_name: dict[str, Node], opts: Options, live_targets: list[transport.Channel],
               reach: Result, report: Report, hardware: Hardware, progress: Progress) -> Result:
    if not opts.bandwidth:
        return skip("busbw", "not asked for (--no-bandwidth)")
    if not alive:
        return skip("busbw", "no node answered")
    if reach.status is Status.FAIL:
        return skip("busbw", "not run: nodes cannot reach each other")
    envs = {o.node: host.python_env(o.get("python")) or {} for o in alive}
    if not all(e.get("torch") for e in envs.values()):
        return skip("busbw", "not run: torch missing on a node")
    invs = [gpu.inventory(o.get("nvidia_smi")) for o in alive]
    gpu_counts = [len(i.gpus) if isinstance(i, gpu.GpuInventory) else 0 for i in invs]
    nproc = min(gpu_counts) if min(gpu_counts) > 0 and all(e.get("cuda_available") for e in envs.values()) else 0
    if len(alive) * max(1, nproc) < 2:
        return skip("busbw", "one rank: no collective to measure")
    first = alive[0]
    model = None
    if nproc and isinstance(invs[0], gpu.GpuInventory):
        model = catalog_gpu(hardware, invs[0].gpus[0].name)
    sweep = bandwidth.Sweep(nnodes=len(alive), nproc_per_node=max(1, nproc),
                            master_addr=_train_address(first, by_name[first.node]), master_port=opts.master_port,
                            backend="nccl" if nproc else "gloo", sizes=opts.sizes, iters=opts.iters,
                            iface=by_name[first.node].train_iface, timeout_s=int(max(60, opts.timeout_s * 3)))
    progress(f"all_reduce sweep: {sweep.nnodes} node(s) x {sweep.nproc_per_node} rank(s), {sweep.backend}")
    inherit = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "NVSHMEM_", "TORCH_SYMM"))} \
        if opts.local else None
    rows, _summary, error = bandwidth.run(live_targets, {o.node: envs[o.node]["executable"] for o in alive}, sweep,
                                         inherit=inherit)
    report.bandwidth = rows
    gate = cluster.bandwidth_gate(hardware, model, len(alive), by_name[first.node].fabric)
    return cluster.check_bandwidth(rows, gate, error)
