"""GPU readings: `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` and NVRM XID kernel log lines.

Every field of GPU_QUERY_FIELDS was queried on the H200 x2 machine (driver 580.159.04) and answered
(tests/fixtures/monitor/h200-x2/). Pure: text in, values out.
"""

from __future__ import annotations

import re

from stepdeploy.monitor.model import GpuSample, XidEvent

GPU_QUERY_FIELDS = (
    "index", "uuid", "pci.bus_id", "memory.used", "utilization.gpu", "temperature.gpu", "power.draw",
    "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
    "remapped_rows.pending", "remapped_rows.failure",
)
_ATTR = {
    "index": "index", "uuid": "uuid", "pci.bus_id": "bus_id", "memory.used": "memory_used_mib",
    "utilization.gpu": "utilization_pct", "temperature.gpu": "temperature_c", "power.draw": "power_w",
    "ecc.errors.uncorrected.volatile.total": "ecc_uncorrected_volatile",
    "ecc.errors.uncorrected.aggregate.total": "ecc_uncorrected_aggregate",
    "remapped_rows.pending": "remap_pending", "remapped_rows.failure": "remap_failure",
}
# Accepted and skipped, so the recorded CSV (tests/fixtures/h200-x2/nvidia-smi-query-gpu*.csv) parses too.
_IGNORED = ("name", "memory.total", "persistence_mode", "pcie.link.gen.current")
# A value that does not look like its field means the columns are not the fields asked for (a stand-in that
# prints another recording): refuse it rather than read a power draw as an ECC count.
_TEXT = {"uuid": re.compile(r"(GPU|MIG)-[0-9a-fA-F-]+"),  # fullmatch
         "bus_id": re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")}
_COUNT = {"index", "ecc_uncorrected_volatile", "ecc_uncorrected_aggregate"}
_FLAG = {"remap_pending", "remap_failure"}
_MISSING = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]", "unknown error"}


def query_command(fields: tuple[str, ...] = GPU_QUERY_FIELDS) -> str:
    return f"nvidia-smi --query-gpu={','.join(fields)} --format=csv,noheader,nounits"


def _value(attr: str, raw: str) -> object:
    text = raw.strip()
    if text.lower() in _MISSING:
        return None
    if attr in _TEXT:
        if not _TEXT[attr].fullmatch(text):
            raise ValueError(f"{attr}: unexpected value {raw.strip()!r}")
        return text
    if attr in _FLAG:
        if text.lower() not in ("yes", "no"):
            raise ValueError(f"{attr}: expected Yes or No, got {raw.strip()!r}")
        return text.lower() == "yes"
    pattern = r"\d+" if attr in _COUNT else r"[-+]?\d+(\.\d+)?"
    number = re.fullmatch(rf"({pattern})(\s*[A-Za-z%]+)?", text)  # tolerates a unit ("143771 MiB") without nounits
    if number is None:
        raise ValueError(f"{attr}: not {'a count' if attr in _COUNT else 'a number'}: {raw.strip()!r}")
    return int(number.group(1)) if attr in _COUNT else float(number.group(1))


def parse_query_csv(text: str, fields: tuple[str, ...] = GPU_QUERY_FIELDS) -> tuple[GpuSample, ...]:
    """One GpuSample per CSV line; ValueError when a line does not have one column per asked field."""
    unknown = [f for f in fields if f not in _ATTR and f not in _IGNORED]
    if unknown or "index" not in fields:
        raise ValueError(f"unsupported fields {unknown} (need 'index'; valid: {', '.join(_ATTR)})")
    gpus = []
    for line in text.splitlines():
        if not line.strip() or line.lower().startswith("index"):  # blank lines, a header if one was asked for
            continue
        cells = line.split(",")
        if len(cells) != len(fields):
            raise ValueError(f"nvidia-smi answered {len(cells)} columns for {len(fields)} fields: {line.strip()!r}")
        values = {_ATTR[f]: _value(_ATTR[f], c) for f, c in zip(fields, cells, strict=True) if f in _ATTR}
        if values["index"] is None:
            raise ValueError(f"no GPU index in {line.strip()!r}")
        gpus.append(GpuSample(**values))  # type: ignore[arg-type]
    return tuple(gpus)


def pci_key(bus_id: str) -> str:
    """ "00000000:3B:00.0" (nvidia-smi) and "PCI:0000:3b:00" (NVRM) -> "0000:3b:00"."""
    text = bus_id.strip().lower().removeprefix("pci:")
    parts = text.split(":")
    if len(parts) < 3:
        return text
    domain, bus, device = parts[-3][-4:], parts[-2], parts[-1].split(".")[0]
    return f"{domain}:{bus}:{device}"


_XID = re.compile(r"(?:\[\s*(?P<time>\d+\.\d+)\]\s*)?.*?NVRM: Xid \((?P<pci>[^)]*)\): (?P<code>\d+)")
_STAMP = re.compile(r"^\[\s*(\d+\.\d+)\]")


def parse_xids(log: str) -> tuple[XidEvent, ...]:
    """Every `NVRM: Xid (PCI:dddd:bb:dd): N, ...` line, with dmesg's timestamp when the line has one."""
    events = []
    for line in log.splitlines():
        match = _XID.search(line)
        if match:
            stamp = match.group("time")
            events.append(XidEvent(pci=pci_key(match.group("pci")), code=int(match.group("code")),
                                   text=line.strip(), time_s=float(stamp) if stamp else None))
    return tuple(events)


def last_stamp(log: str) -> float | None:
    """The timestamp of the last stamped kernel log line (the watermark for "new since the last sample")."""
    stamps = [float(m.group(1)) for line in log.splitlines() if (m := _STAMP.match(line.strip()))]
    return max(stamps) if stamps else None


def gpu_for_xid(event: XidEvent, gpus: tuple[GpuSample, ...]) -> int | None:
    return next((g.index for g in gpus if g.bus_id and pci_key(g.bus_id) == event.pci), None)
