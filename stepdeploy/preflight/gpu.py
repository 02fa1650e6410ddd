"""GPU checks over `nvidia-smi -q -x`, `nvidia-smi topo -m` and the kernel log. Pure: text in, results out."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from stepdeploy.preflight.model import Result, Section, fail, ok, skip, warning

# FACTS (reliability anchors; Azure aznhc): application-level XIDs warn, hardware ones drain the node.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
HARDWARE_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
DRAIN_FIX = "drain the node: stop scheduling on it, reset the GPU (nvidia-smi -r) or reboot, and open a hardware ticket"


@dataclass(frozen=True)
class NodeGpu:
    index: int
    name: str
    bus_id: str
    memory_mib: int | None
    persistence: str
    ecc_mode: str
    uncorrectable_volatile: int
    uncorrectable_aggregate: int
    correctable_aggregate: int
    remap_pending: bool
    remap_failure: bool


@dataclass(frozen=True)
class GpuInventory:
    driver: str
    cuda: str
    gpus: tuple[NodeGpu, ...]


def _int(text: str | None) -> int:
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match else 0


def _sum(node: ET.Element | None, tags: tuple[str, ...]) -> int:
    if node is None:
        return 0
    return sum(_int(node.findtext(tag)) for tag in tags)


UNCORRECTABLE = ("dram_uncorrectable", "sram_uncorrectable_parity", "sram_uncorrectable_secded",
                 "sram_uncorrectable", "double_bit/total")
CORRECTABLE = ("dram_correctable", "sram_correctable", "single_bit/total")


def parse_smi_xml(text: str) -> GpuInventory:
    """The facts preflight needs from `nvidia-smi -q -x` (ValueError if it is not that XML)."""
    try:
        root = ET.fromstring(text[text.find("<?xml"):] if "<?xml" in text else text)
    except ET.ParseError as exc:
        raise ValueError(f"not nvidia-smi XML: {exc}") from None
    gpus = []
    for i, g in enumerate(root.findall("gpu")):
        ecc = g.find("ecc_errors")
        remap = g.find("remapped_rows")
        gpus.append(NodeGpu(
            index=_int(g.findtext("minor_number")) if g.findtext("minor_number", "").strip().isdigit() else i,
            name=(g.findtext("product_name") or "").strip(), bus_id=g.get("id", ""),
            memory_mib=_int(g.findtext("fb_memory_usage/total")) or None,
            persistence=(g.findtext("persistence_mode") or "").strip(),
            ecc_mode=(g.findtext("ecc_mode/current_ecc") or "").strip(),
            uncorrectable_volatile=_sum(ecc.find("volatile") if ecc is not None else None, UNCORRECTABLE),
            uncorrectable_aggregate=_sum(ecc.find("aggregate") if ecc is not None else None, UNCORRECTABLE),
            correctable_aggregate=_sum(ecc.find("aggregate") if ecc is not None else None, CORRECTABLE),
            remap_pending=(remap is not None and (remap.findtext("remapped_row_pending") or "").strip() == "Yes"),
            remap_failure=(remap is not None and (remap.findtext("remapped_row_failure") or "").strip() == "Yes"),
        ))
    return GpuInventory(driver=(root.findtext("driver_version") or "").strip(),
                        cuda=(root.findtext("cuda_version") or "").strip(), gpus=tuple(gpus))


def inventory(section: Section) -> GpuInventory | str | None:
    """The node's GPUs; None when the node has no NVIDIA stack; a string saying why it could not be read."""
    if section.rc == 127 or ("not found" in section.text and section.rc != 0):
        return None
    if not section.ok:
        return f"nvidia-smi -q -x exited {section.rc}: {section.text.strip()[-200:]}"
    try:
        return parse_smi_xml(section.text)
    except ValueError as exc:
        return str(exc)


def _models(gpus: tuple[NodeGpu, ...]) -> str:
    names = sorted({g.name for g in gpus})
    mem = sorted({g.memory_mib for g in gpus if g.memory_mib})
    return f"{len(gpus)}x {'/'.join(names) or '?'}" + (f" {'/'.join(map(str, mem))} MiB" if mem else "")


def check_gpus(inv: GpuInventory | str | None, expected_count: int | None, expected_model: str | None,
               catalog_memory_mib: int | None = None) -> Result:
    """Count, model and memory of the GPUs against the inventory's declaration (and the catalog)."""
    want = f"{expected_count}x {expected_model or 'any model'}" if expected_count is not None else "as found"
    if isinstance(inv, str):
        return fail("gpus", inv, want, "check the driver: nvidia-smi must list every GPU (dmesg for NVRM errors)")
    if inv is None:
        if expected_count:
            return fail("gpus", "no nvidia-smi (no NVIDIA driver)", want,
                        "install the driver (stepdeploy provision) or set stepdeploy_gpus_per_node=0")
        return skip("gpus", "no NVIDIA GPU on this node")
    seen = _models(inv.gpus)
    if expected_count is not None and len(inv.gpus) != expected_count:
        return fail("gpus", seen, want, "a GPU is missing or extra: check nvidia-smi -L, dmesg (fallen off the bus?), "
                                        "reseat/replace it, or correct stepdeploy_gpus_per_node")
    if expected_model and any(expected_model.lower() not in g.name.lower() for g in inv.gpus):
        return fail("gpus", seen, want, "correct stepdeploy_gpu_model or move the node to the right group")
    if len({g.name for g in inv.gpus}) > 1:
        return warning("gpus", seen, "one GPU model per node", "mixed GPU models slow every collective to the slowest")
    if catalog_memory_mib and any(g.memory_mib and g.memory_mib < catalog_memory_mib for g in inv.gpus):
        return warning("gpus", seen, f"{catalog_memory_mib} MiB each (hardware catalog)",
                    "a GPU reports less memory than its model has: check for MIG or a degraded board")
    return ok("gpus", seen, want)


def check_driver(inv: GpuInventory | str | None, profile_driver: str | None) -> Result:
    if not isinstance(inv, GpuInventory):
        return skip("driver", "no NVIDIA driver")
    if profile_driver and inv.driver != profile_driver:
        return warning("driver", inv.driver, f"{profile_driver} (stack profile)",
                    "run `stepdeploy provision` to install the profile's driver, or pick the profile that matches")
    return ok("driver", inv.driver, profile_driver or "")


def _mm(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:2])


def check_cuda(inv: GpuInventory | str | None, profile_cuda: str | None) -> Result:
    """The driver's CUDA version (the newest runtime it supports) must cover the profile's toolkit."""
    if not isinstance(inv, GpuInventory):
        return skip("cuda", "no NVIDIA driver")
    if profile_cuda and _mm(inv.cuda) < _mm(profile_cuda):
        return fail("cuda", f"driver supports CUDA {inv.cuda}", f">= {profile_cuda} (stack profile)",
                    f"install a driver for CUDA {profile_cuda} (see the compatibility matrix) or use an older profile")
    return ok("cuda", f"driver supports CUDA {inv.cuda}", profile_cuda or "")


def check_persistence(inv: GpuInventory | str | None) -> Result:
    if not isinstance(inv, GpuInventory):
        return skip("persistence", "no NVIDIA driver")
    off = [g.index for g in inv.gpus if g.persistence != "Enabled"]
    if off:
        return warning("persistence", f"off on GPU {', '.join(map(str, off))}", "Enabled on every GPU",
                    "systemctl enable --now nvidia-persistenced (or nvidia-smi -pm 1)")
    return ok("persistence", "Enabled on every GPU")


def check_ecc(inv: GpuInventory | str | None) -> Result:
    if not isinstance(inv, GpuInventory):
        return skip("ecc", "no NVIDIA driver")
    bad = [f"GPU {g.index} ({g.bus_id}): {g.uncorrectable_volatile} volatile / {g.uncorrectable_aggregate} "
           f"aggregate" for g in inv.gpus if g.uncorrectable_volatile or g.uncorrectable_aggregate]
    if bad:
        return fail("ecc", "uncorrectable ECC errors: " + "; ".join(bad), "0 uncorrectable", DRAIN_FIX)
    disabled = [g.index for g in inv.gpus if g.ecc_mode and g.ecc_mode != "Enabled"]
    if disabled:
        return warning("ecc", f"ECC off on GPU {', '.join(map(str, disabled))}", "ECC Enabled",
                    "nvidia-smi -e 1 and reboot: without ECC memory errors corrupt training silently")
    corrected = sum(g.correctable_aggregate for g in inv.gpus)
    return ok("ecc", f"0 uncorrectable ({corrected} corrected, aggregate)", "0 uncorrectable")


def check_remap(inv: GpuInventory | str | None) -> Result:
    if not isinstance(inv, GpuInventory):
        return skip("row_remap", "no NVIDIA driver")
    pending = [g.index for g in inv.gpus if g.remap_pending]
    failed = [g.index for g in inv.gpus if g.remap_failure]
    if failed:
        return fail("row_remap", f"row remapping failed on GPU {', '.join(map(str, failed))}",
                    "no pending or failed remaps", DRAIN_FIX)
    if pending:
        return fail("row_remap", f"row remap pending on GPU {', '.join(map(str, pending))}",
                    "no pending or failed remaps", "drain the node and reset the GPU (nvidia-smi -r) so the "
                                                   "remap takes effect; replace it if the remap fails")
    return ok("row_remap", "no pending or failed remaps")


_XID = re.compile(r"NVRM: Xid \((?P<where>[^)]*)\): (?P<code>\d+)")


def parse_xids(log: str) -> list[tuple[str, int]]:
    """(device, xid) for every `NVRM: Xid (PCI:...): N, ...` line of a kernel log."""
    return [(m.group("where"), int(m.group("code"))) for m in _XID.finditer(log)]


def check_xid(section: Section, has_gpus: bool) -> Result:
    if not section.ok:
        return warning("xid", section.text.strip()[-200:] or f"exit {section.rc}", "a readable kernel log",
                    "run preflight as root (dmesg needs CAP_SYSLOG) or allow kernel.dmesg_restrict=0")
    events = parse_xids(section.text)
    if not events:
        return ok("xid", "no XID events in the kernel log") if has_gpus else skip("xid", "no NVIDIA GPU")
    codes = sorted({c for _, c in events})
    listed = ", ".join(f"{c} x{sum(1 for _, x in events if x == c)}" for c in codes)
    hardware = [c for c in codes if c in HARDWARE_XIDS]
    if hardware:
        return fail("xid", f"XID {listed}", "no hardware XIDs (48/63/64/74/79/92/94/95/119/120)", DRAIN_FIX)
    return warning("xid", f"XID {listed}", "no XIDs", "application-level XIDs (13/31/43/45/68/109): check the job that "
                                                  "ran then; unknown codes: look them up in NVIDIA's XID catalog")


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """{(gpu_a, gpu_b): link} from `nvidia-smi topo -m` (X, NV#, PIX, PXB, PHB, NODE, SYS)."""
    clean = re.sub(r"\x1b\[[0-9;]*m", "", text)
    rows = [line.split() for line in clean.splitlines() if re.match(r"^GPU\d+\s", line)]
    links: dict[tuple[int, int], str] = {}
    gpu_count = len(rows)
    for row in rows:
        a = int(row[0][3:])
        for b, cell in enumerate(row[1:1 + gpu_count]):
            if a != b:
                links[(a, b)] = cell
    return links


def check_topology(section: Section, inv: GpuInventory | str | None, nvlink_expected: bool) -> Result:
    if not isinstance(inv, GpuInventory) or len(inv.gpus) < 2:
        return skip("topology", "fewer than 2 GPUs")
    if not section.ok:
        return warning("topology", f"nvidia-smi topo -m exited {section.rc}", "a GPU link matrix",
                    "check the driver and the fabric manager (nvidia-fabricmanager) on NVSwitch systems")
    links = parse_topology(section.text)
    kinds = sorted(set(links.values()))
    observed = f"{len(inv.gpus)} GPUs, links {'/'.join(kinds) or 'none'}"
    slow = sorted({f"GPU{a}-GPU{b} {k}" for (a, b), k in links.items() if a < b and not k.startswith("NV")})
    if nvlink_expected and slow:
        return warning("topology", observed + f" ({', '.join(slow[:4])})", "NVLink between every GPU pair",
                    "GPU pairs over PCIe: check nvidia-fabricmanager and `nvidia-smi nvlink -s` for links down")
    return ok("topology", observed, "NVLink between every GPU pair" if nvlink_expected else "")
