"""Prometheus textfile (node_exporter's textfile collector) with the current values of every node's sample.

GPU metrics carry DCGM exporter's names and labels (gpu, UUID, pci_bus_id, Hostname), so dashboards built
for dcgm-exporter read them. Metrics DCGM has no field for are `stepdeploy_*` (not node_exporter's own
`node_infiniband_*` names: the textfile collector refuses a name another collector also exports).
The file is written atomically (temporary file in the same directory, then rename): a scrape never reads
half a file.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from stepdeploy.monitor.model import GpuSample, NodeSample
from stepdeploy.monitor.parse_gpu import gpu_for_xid
from stepdeploy.monitor.parse_host import IB_ERROR_COUNTERS, IB_INFO_COUNTERS, IB_RETRANSMIT_COUNTERS

Sample = tuple[str, dict[str, str], float]

HELP = {
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB)."),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C)."),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("counter", "Total number of double-bit (uncorrectable) volatile ECC errors."),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": ("counter", "Total number of double-bit (uncorrectable) persistent ECC errors."),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("gauge", "Whether a row remap is pending (GPU reset needed)."),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("gauge", "Whether row remapping has failed."),
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", "Value of the last XID error encountered."),
    "stepdeploy_ib_port_active": ("gauge", "1 when the InfiniBand/RoCE port state is ACTIVE."),
    "stepdeploy_ib_counter_total": ("counter", "InfiniBand port counter from sysfs (counters/, hw_counters/)."),
    "stepdeploy_netdev_up": ("gauge", "1 when the interface operstate is up."),
    "stepdeploy_netdev_stat_total": ("counter", "Interface statistic from /sys/class/net/<if>/statistics."),
    "stepdeploy_host_memory_available_bytes": ("gauge", "MemAvailable from /proc/meminfo."),
    "stepdeploy_host_memory_total_bytes": ("gauge", "MemTotal from /proc/meminfo."),
    "stepdeploy_disk_available_bytes": ("gauge", "Free space where checkpoints go."),
    "stepdeploy_disk_total_bytes": ("gauge", "Size of the file system where checkpoints go."),
    "stepdeploy_heartbeat_age_seconds": ("gauge", "Seconds since the rank's last heartbeat."),
    "stepdeploy_train_iteration": ("gauge", "Iteration of the last metrics line."),
    "stepdeploy_train_loss": ("gauge", "Loss of the last metrics line."),
    "stepdeploy_train_grad_norm": ("gauge", "Gradient norm of the last metrics line."),
    "stepdeploy_train_rank_step_time_seconds": ("gauge", "Each rank's step time in the last metrics line."),
    "stepdeploy_sample_errors": ("gauge", "Probe sections that could not be read in the last sample."),
}


def _gpu(gpu: GpuSample, host: str, last_xid: int) -> Iterable[Sample]:
    labels = {"gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": gpu.bus_id, "Hostname": host}
    values = {
        "DCGM_FI_DEV_GPU_UTIL": gpu.utilization_pct, "DCGM_FI_DEV_FB_USED": gpu.memory_used_mib,
        "DCGM_FI_DEV_GPU_TEMP": gpu.temperature_c, "DCGM_FI_DEV_POWER_USAGE": gpu.power_w,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": gpu.ecc_uncorrected_volatile,
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": gpu.ecc_uncorrected_aggregate,
        "DCGM_FI_DEV_ROW_REMAP_PENDING": gpu.remap_pending, "DCGM_FI_DEV_ROW_REMAP_FAILURE": gpu.remap_failure,
        "DCGM_FI_DEV_XID_ERRORS": last_xid,
    }
    return [(name, labels, float(value)) for name, value in values.items() if value is not None]


def _network(sample: NodeSample) -> Iterable[Sample]:
    host, out = sample.node, []
    for port in sample.ib_ports:
        labels = {"device": port.device, "port": str(port.port), "Hostname": host}
        out.append(("stepdeploy_ib_port_active", labels, float(port.state == "ACTIVE")))
        counters = {**port.counters, **port.hw_counters}
        for name in IB_ERROR_COUNTERS + IB_INFO_COUNTERS + IB_RETRANSMIT_COUNTERS:
            if name in counters:
                out.append(("stepdeploy_ib_counter_total", {**labels, "counter": name}, float(counters[name])))
    for dev in sample.netdevs:
        labels = {"device": dev.name, "Hostname": host}
        out.append(("stepdeploy_netdev_up", labels, float(dev.operstate == "up")))
        out += [("stepdeploy_netdev_stat_total", {**labels, "stat": k}, float(v)) for k, v in sorted(dev.stats.items())]
    return out


def _host_and_training(sample: NodeSample) -> Iterable[Sample]:
    host, out = {"Hostname": sample.node}, []
    for key, name in (("MemAvailable", "available"), ("MemTotal", "total")):
        if key in sample.meminfo_kib:
            out.append((f"stepdeploy_host_memory_{name}_bytes", host, sample.meminfo_kib[key] * 1024.0))
    if sample.disk is not None:
        labels = {**host, "path": sample.disk.path}
        out += [("stepdeploy_disk_available_bytes", labels, float(sample.disk.available_bytes)),
                ("stepdeploy_disk_total_bytes", labels, float(sample.disk.total_bytes))]
    out += [("stepdeploy_heartbeat_age_seconds", {**host, "rank": str(b.rank)}, sample.time - b.time)
            for b in sample.heartbeats]
    if sample.metrics:
        last = sample.metrics[-1]
        for name, value in (("iteration", last.iteration), ("loss", last.loss), ("grad_norm", last.grad_norm)):
            if value is not None:
                out.append((f"stepdeploy_train_{name}", host, float(value)))
        out += [("stepdeploy_train_rank_step_time_seconds", {**host, "rank": str(r)}, t)
                for r, t in enumerate(last.rank_step_time_s)]
    out.append(("stepdeploy_sample_errors", host, float(len(sample.errors))))
    return out


def _node(sample: NodeSample) -> list[Sample]:
    last_xid = {}
    for event in sample.xids:  # in log order: the last one wins
        index = gpu_for_xid(event, sample.gpus)
        if index is not None:
            last_xid[index] = event.code
    out = [s for g in sample.gpus for s in _gpu(g, sample.node, last_xid.get(g.index, 0))]
    return out + list(_network(sample)) + list(_host_and_training(sample))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def render(samples: Iterable[NodeSample]) -> str:
    """The exposition text: every metric's HELP and TYPE once, its series together (the format requires it)."""
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for sample in samples:
        for name, labels, value in _node(sample):
            series.setdefault(name, []).append((labels, value))
    lines = []
    for name in (n for n in HELP if n in series):
        kind, text = HELP[name]
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for labels, value in series[name]:
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{body}}} {_number(value)}")
    return "\n".join(lines) + "\n"


def write_textfile(path: Path, text: str) -> None:
    """Replace `path` atomically (node_exporter reads *.prom; the temporary name does not end in .prom)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
