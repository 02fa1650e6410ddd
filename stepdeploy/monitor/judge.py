"""Judgements of a node's hardware between two samples: GPU ECC/remap/XID, IB/RoCE ports, netdevs, host.

Every judgement reports a change, never a standing total: a counter that rose, a state that turned bad,
an XID logged after the previous sample. A condition already present in the previous sample was reported
then (or by preflight), so a steady node raises nothing, however old its counters. A counter that went
down was reset (driver reload, reboot): its delta is its new value.

A `link` finding is a failure (a port or interface not up now, link_downed rose on a port not ACTIVE now) except a
flap: an interface or IB port that went down and came up again between two samples (its carrier_down_count or
link_downed rose, it is up / ACTIVE now) is a `link` warning.
A judgement sees samples only; whether the run trained through the flap is for its caller to weigh.
"""

from __future__ import annotations

from stepdeploy.monitor.model import Finding, GpuSample, IbPort, MonitorLimits, NetDev, NodeSample, Severity
from stepdeploy.monitor.parse_gpu import gpu_for_xid
from stepdeploy.monitor.parse_host import (
    CARRIER_DOWN,
    IB_ERROR_COUNTERS,
    IB_RETRANSMIT_COUNTERS,
    NETDEV_DROP_STATS,
    NETDEV_ERROR_STATS,
)
from stepdeploy.preflight.gpu import APPLICATION_XIDS, DRAIN_FIX, HARDWARE_XIDS

WARN, FAIL = Severity.WARN, Severity.FAIL
LINK_FIX = ("check the cable/transceiver and the switch port (ibstat, ibv_devinfo, `ip link`), then run "
            "`stepdeploy preflight` on the node before restarting")


def delta(before: int | None, after: int | None) -> int:
    if before is None or after is None:
        return 0
    return after if after < before else after - before


def judge_node(prev: NodeSample, cur: NodeSample, limits: MonitorLimits | None = None) -> list[Finding]:
    """What changed for the worse on one node between two of its samples."""
    limits = limits or MonitorLimits()
    found = [*_gpus(prev, cur), *_xids(prev, cur), *_ib(prev, cur), *_netdevs(prev, cur, limits),
             *_host(prev, cur, limits), *_unreadable(prev, cur)]
    return [Finding(f.kind, f.severity, f.subject, f.message, cur.node, f.fix) for f in found]


def _gpu_pair(before: GpuSample, after: GpuSample) -> list[Finding]:
    subject, found = f"gpu {after.index}", []
    for name, attr in (("volatile", "ecc_uncorrected_volatile"), ("aggregate", "ecc_uncorrected_aggregate")):
        old, new = getattr(before, attr), getattr(after, attr)
        if (rise := delta(old, new)) > 0:
            found.append(Finding("ecc", FAIL, subject, f"uncorrectable ECC errors ({name}) +{rise}: {old} -> {new}",
                                 fix=DRAIN_FIX))
    if after.remap_pending and not before.remap_pending:
        found.append(Finding("row_remap", FAIL, subject, "row remap pending (GPU reset needed to apply it)",
                             fix="drain the node and reset the GPU (nvidia-smi -r); replace it if the remap fails"))
    if after.remap_failure and not before.remap_failure:
        found.append(Finding("row_remap", FAIL, subject, "row remapping failed", fix=DRAIN_FIX))
    return found


def _gpus(prev: NodeSample, cur: NodeSample) -> list[Finding]:
    found = []
    for before in prev.gpus:
        after = cur.gpu(before.index)
        if after is None:
            if "gpu" not in cur.errors:
                found.append(Finding("gpu_lost", FAIL, f"gpu {before.index}", "GPU no longer listed by nvidia-smi",
                                     fix=DRAIN_FIX))
        elif not (before.uuid and after.uuid and before.uuid != after.uuid):  # renumbered: not comparable
            found += _gpu_pair(before, after)
    return found


def new_xids(prev: NodeSample, cur: NodeSample) -> list:
    """XIDs logged after the previous sample: by dmesg timestamp when both sides have one, else by line."""
    seen = {e.text for e in prev.xids}
    mark = prev.kernel_mark_s
    return [e for e in cur.xids
            if (e.time_s > mark if mark is not None and e.time_s is not None else e.text not in seen)]


def _xids(prev: NodeSample, cur: NodeSample) -> list[Finding]:
    found = []
    for event in new_xids(prev, cur):
        index = gpu_for_xid(event, cur.gpus) if cur.gpus else gpu_for_xid(event, prev.gpus)
        subject = f"gpu {index}" if index is not None else f"pci {event.pci}"
        if event.code in HARDWARE_XIDS:
            found.append(Finding("xid", FAIL, subject, f"hardware XID {event.code}: {event.text}", fix=DRAIN_FIX))
        else:
            kind = "application-level" if event.code in APPLICATION_XIDS else "unlisted"
            found.append(Finding("xid", WARN, subject, f"{kind} XID {event.code}: {event.text}",
                                 fix="check the job's logs at that time (illegal address, memory fault, "
                                     "timeout); look unlisted codes up in NVIDIA's XID catalog"))
    return found


def _ib_pair(before: IbPort, after: IbPort) -> list[Finding]:
    found, subject = [], after.name
    if before.state == "ACTIVE" and after.state != "ACTIVE":
        found.append(Finding("link", FAIL, subject, f"IB port {before.state} -> {after.state or '?'} "
                                                    f"({after.phys_state or 'phys state ?'})", fix=LINK_FIX))
    for group, names in (("counters", IB_ERROR_COUNTERS), ("hw_counters", IB_RETRANSMIT_COUNTERS)):
        old, new = getattr(before, group), getattr(after, group)
        for name in names:
            if (rise := delta(old.get(name), new.get(name))) <= 0:
                continue
            if name == "link_downed" and before.state == after.state == "ACTIVE":
                # down and ACTIVE again between two samples, as a carrier flap: a warning here; whether the run
                # rode it out is the soak's call (rollout/monitors.grade_flaps)
                found.append(Finding("link", WARN, subject, f"IB port went down {rise} time(s) since the previous "
                                     f"sample (link_downed {old[name]} -> {new[name]}; now ACTIVE)", fix=LINK_FIX))
                continue
            severity = FAIL if name == "link_downed" else WARN
            found.append(Finding("ib_counter", severity, subject, f"{name} +{rise} ({old[name]} -> {new[name]})",
                                 fix=LINK_FIX))
    return found


def _ib(prev: NodeSample, cur: NodeSample) -> list[Finding]:
    now = {p.name: p for p in cur.ib_ports}
    found = []
    for before in prev.ib_ports:
        after = now.get(before.name)
        if after is None and before.state == "ACTIVE" and "ib" not in cur.errors:
            found.append(Finding("link", FAIL, before.name, "IB port vanished", fix=LINK_FIX))
        elif after is not None:
            found += _ib_pair(before, after)
    return found


def _netdev_pair(before: NetDev, after: NetDev, limits: MonitorLimits) -> list[Finding]:
    found = []
    if before.operstate == "up" and after.operstate != "up":
        found.append(Finding("link", FAIL, after.name, f"interface {before.operstate} -> {after.operstate}",
                             fix=LINK_FIX))
    flaps = delta(before.stats.get(CARRIER_DOWN), after.stats.get(CARRIER_DOWN))
    if flaps and CARRIER_DOWN in before.stats:  # down and up again between two samples: operstate misses it
        # up again: a warning here; whether the run rode it out is the soak's call (rollout/monitors.grade_flaps)
        severity = WARN if after.operstate == "up" else FAIL
        found.append(Finding("link", severity, after.name, f"link went down {flaps} time(s) since the previous "
                             f"sample (now {after.operstate})", fix=LINK_FIX))
    for name in NETDEV_ERROR_STATS + NETDEV_DROP_STATS:
        rise = delta(before.stats.get(name), after.stats.get(name))
        limit = limits.netdev_drops_per_interval if name in NETDEV_DROP_STATS else 0
        if rise > limit:
            found.append(Finding("netdev", WARN, after.name, f"{name} +{rise} (limit {limit} per sample)",
                                 fix=LINK_FIX))
    return found


def _netdevs(prev: NodeSample, cur: NodeSample, limits: MonitorLimits) -> list[Finding]:
    now = {d.name: d for d in cur.netdevs}
    found = []
    for before in prev.netdevs:
        if before.name in now:
            found += _netdev_pair(before, now[before.name], limits)
        elif before.operstate == "up" and "net" not in cur.errors:
            found.append(Finding("link", FAIL, before.name, "interface vanished", fix=LINK_FIX))
    return found


def _memory_low(sample: NodeSample, limits: MonitorLimits) -> float | None:
    total, available = sample.meminfo_kib.get("MemTotal"), sample.meminfo_kib.get("MemAvailable")
    if not total or available is None:
        return None
    share = available / total
    return share if share < limits.host_memory_min_available else None


def _disk_level(sample: NodeSample, limits: MonitorLimits) -> int:
    disk = sample.disk
    if disk is None or not disk.total_bytes:
        return 0
    free = disk.available_bytes / disk.total_bytes
    return 2 if free < limits.disk_min_free / 5 else 1 if free < limits.disk_min_free else 0


def _host(prev: NodeSample, cur: NodeSample, limits: MonitorLimits) -> list[Finding]:
    found = []
    share = _memory_low(cur, limits)
    if share is not None and _memory_low(prev, limits) is None:
        found.append(Finding("host_memory", WARN, "node", f"MemAvailable {share:.1%} of MemTotal "
                             f"(limit {limits.host_memory_min_available:.0%})",
                             fix="find what grows (dataloader workers, pinned memory); the OOM killer is next"))
    level = _disk_level(cur, limits)
    if level > _disk_level(prev, limits) and cur.disk is not None:
        disk = cur.disk
        found.append(Finding("disk", FAIL if level == 2 else WARN, disk.path,
                             f"{disk.available_bytes / 2**30:.1f} GiB free of {disk.total_bytes / 2**30:.1f} GiB "
                             f"(limit {limits.disk_min_free:.0%})",
                             fix="free space where checkpoints go (remove old iter_* directories) before a save "
                                 "fails half-written"))
    return found


def _unreadable(prev: NodeSample, cur: NodeSample) -> list[Finding]:
    found = []
    for section, why in sorted(cur.errors.items()):
        if section not in prev.errors:
            severity = FAIL if section == "gpu" and prev.gpus else WARN
            found.append(Finding("unreadable", severity, section, f"{section} could not be read: {why}",
                                 fix="see the diagnosis of this text (stepdeploy.monitor.diagnose)"))
    return found
