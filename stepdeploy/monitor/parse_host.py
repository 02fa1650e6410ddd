"""Host readings: InfiniBand/RoCE ports, netdev statistics, /proc/meminfo, df. Pure: text in, values out.

The sysfs readings arrive as `grep -H . FILES` prints them, one `relative/path:value` per line, run from
/sys/class/infiniband (`mlx5_0/ports/1/counters/symbol_error:0`) or /sys/class/net (`eth0/operstate:up`).
"""

from __future__ import annotations

from collections import defaultdict

from stepdeploy.monitor.model import Disk, IbPort, NetDev

# FACTS (reliability anchors): the IB counters whose increase means trouble, and the retransmit counters.
IB_ERROR_COUNTERS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors",
                     "port_xmit_discards", "excessive_buffer_overrun_errors", "local_link_integrity_errors")
IB_INFO_COUNTERS = ("port_xmit_wait", "port_xmit_data", "port_rcv_data")  # exported, never judged alone
IB_RETRANSMIT_COUNTERS = ("local_ack_timeout_err", "packet_seq_err", "out_of_sequence", "rnr_nak_retry_err")
NETDEV_ERROR_STATS = ("rx_errors", "tx_errors", "rx_crc_errors", "rx_frame_errors", "tx_carrier_errors")
NETDEV_DROP_STATS = ("rx_dropped", "tx_dropped")
CARRIER_DOWN = "carrier_down_count"  # /sys/class/net/IF/carrier_down_count: how often the link went down


def _sysfs_lines(text: str) -> list[tuple[list[str], str]]:
    rows = []
    for line in text.splitlines():
        path, sep, value = line.partition(":")
        if sep and path.strip():
            rows.append((path.strip().split("/"), value.strip()))
    return rows


def _int(value: str) -> int | None:
    try:
        return int(value.split()[0])
    except (ValueError, IndexError):
        return None


def _state_name(value: str) -> str:
    """"4: ACTIVE" -> "ACTIVE"; "5: LinkUp" -> "LinkUp"."""
    return value.split(":", 1)[-1].strip()


def parse_ib(text: str) -> tuple[IbPort, ...]:
    """Ports from `grep -H . */ports/*/{state,phys_state,counters/*,hw_counters/*}` in /sys/class/infiniband."""
    fields: dict[tuple[str, int], dict[str, object]] = defaultdict(
        lambda: {"state": "", "phys_state": "", "counters": {}, "hw_counters": {}})
    for parts, value in _sysfs_lines(text):
        if len(parts) < 4 or parts[1] != "ports" or not parts[2].isdigit():
            continue
        entry = fields[(parts[0], int(parts[2]))]
        if len(parts) == 4 and parts[3] in ("state", "phys_state"):
            entry[parts[3]] = _state_name(value)
        elif len(parts) == 5 and parts[3] in ("counters", "hw_counters") and _int(value) is not None:
            entry[parts[3]][parts[4]] = _int(value)  # type: ignore[index]
    return tuple(IbPort(device=dev, port=port, **entry)  # type: ignore[arg-type]
                 for (dev, port), entry in sorted(fields.items()))


def parse_netdevs(text: str) -> tuple[NetDev, ...]:
    """Interfaces from `grep -H . IF/operstate IF/statistics/*` in /sys/class/net."""
    state: dict[str, str] = {}
    stats: dict[str, dict[str, int]] = defaultdict(dict)
    for parts, value in _sysfs_lines(text):
        if len(parts) == 2 and parts[1] == "operstate":
            state[parts[0]] = value
        elif len(parts) == 2 and parts[1] == CARRIER_DOWN and _int(value) is not None:
            stats[parts[0]][CARRIER_DOWN] = _int(value)  # type: ignore[assignment]
        elif len(parts) == 3 and parts[1] == "statistics" and _int(value) is not None:
            stats[parts[0]][parts[2]] = _int(value)  # type: ignore[assignment]
    names = sorted(set(state) | set(stats))
    return tuple(NetDev(name=n, operstate=state.get(n, "unknown"), stats=dict(stats[n])) for n in names)


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo -> {"MemTotal": kib, "MemAvailable": kib, ...}."""
    out = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        value = _int(rest)
        if sep and value is not None:
            out[key.strip()] = value
    return out


def parse_df(text: str) -> Disk | None:
    """The probe's disk section: the path asked about (or its nearest existing parent), then `df -P -k`."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    data = [row for row in lines if len(row) >= 6 and row[1].isdigit() and row[3].isdigit()]
    if not data:
        return None
    path = lines[0][0] if len(lines[0]) == 1 else data[-1][-1]
    return Disk(path=path, total_bytes=int(data[-1][1]) * 1024, available_bytes=int(data[-1][3]) * 1024)
