"""The workload's own files (stepdeploy/workload/metrics.py): heartbeats, status files, metrics.jsonl.

The probe prints heartbeats and status files one per line as `<file name> <json>`, and the tail of
metrics.jsonl as it is. Every record goes through stepdeploy/noderecords.py's schema: a line that is not JSON
(a file caught mid-rewrite is impossible: they are written atomically, but a metrics line can be cut by `tail`)
or breaks the schema is skipped and counted in the caller's `Tally` (the node's fault), never fatal. Pure: text
in, values out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

from stepdeploy import noderecords
from stepdeploy.monitor.model import Heartbeat, MetricsRow, RankFile
from stepdeploy.noderecords import Tally

T = TypeVar("T")

# The workload's metric keys (stepdeploy/workload/metrics.py METRIC_KEYS, which cannot be imported here:
# it is shipped to the nodes as a loose file) that the rollout records in the ledger and the report
# reads back.
METRIC_NAMES = ("loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "rank_step_time_s",
                "mem_allocated_gib", "mem_reserved_gib", "mem_peak_gib", "mfu",
                "moe_load_max", "moe_dropped", "router_bias_absmax", "moe_aux_loss_mean")
# per-layer metrics of MoE models ({layer: value} in a metrics line): ledger rows named "<name>/<layer>"; the MTP
# losses ([one per MTP layer]): "mtp_loss/<k>" (k from 1)
LAYER_METRICS = ("moe_load", "router_bias", "moe_aux_loss")
MTP_LOSS = "mtp_loss"

_RANK = re.compile(r"rank(\d{1,7})")


def _rank_lines(text: str, section: str, parse: Callable[[Any], T], tally: Tally) -> list[tuple[int | None, T]]:
    """`<file name> <json>` lines -> (rank in the file name, checked record); the others counted in `tally`."""
    out = []
    for line in text.splitlines():
        name, _, body = line.strip().partition(" ")
        if not name:
            continue
        match = _RANK.search(name)
        try:
            out.append((int(match.group(1)) if match else None, parse(noderecords.loads(body))))
        except noderecords.BadRecord as exc:
            tally.note(f"{section}/{name[:100]}", str(exc))
    return out


def parse_heartbeats(text: str, tally: Tally | None = None) -> tuple[Heartbeat, ...]:
    """Every valid heartbeat (noderecords.heartbeat_record) of a file named rank<R>; the rest counted."""
    tally = Tally() if tally is None else tally
    beats = [Heartbeat(rank=rank, iteration=beat.iteration, time=beat.time, pid=beat.pid)
             for rank, beat in _rank_lines(text, "out/heartbeat", noderecords.heartbeat_record, tally)
             if rank is not None]
    return tuple(sorted(beats, key=lambda b: b.rank))


def parse_statuses(text: str, tally: Tally | None = None) -> tuple[RankFile, ...]:
    """Every valid status file (noderecords.status_record); its rank from the file when it says, else its name."""
    tally = Tally() if tally is None else tally
    files = []
    for name_rank, status in _rank_lines(text, "out/status", noderecords.status_record, tally):
        rank = status.rank if status.rank is not None else name_rank
        if rank is None:
            tally.note("out/status", "a status file without a rank")
            continue
        files.append(RankFile(rank=rank, state=status.state, pid=status.pid, node=status.node, code=status.code,
                              reason=status.reason))
    return tuple(sorted(files, key=lambda f: f.rank))


def parse_proc_states(text: str) -> dict[int, str]:
    """`rank<R> <pid> <state>` lines -> {rank: state letter from /proc/<pid>/stat}."""
    states = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].startswith("rank") and parts[0][4:].isdigit():
            states[int(parts[0][4:])] = parts[2]
    return states


def parse_metrics(text: str, tally: Tally | None = None) -> tuple[MetricsRow, ...]:
    """The valid lines of metrics.jsonl's tail (noderecords.metrics_record; NaN losses kept: they are judged)."""
    tally = Tally() if tally is None else tally
    rows = []
    for data in noderecords.parse_lines(text, noderecords.metrics_record, "out/metrics.jsonl", tally,
                                        allow_nan=True):
        rows.append(MetricsRow(
            iteration=data["iteration"], loss=data.get("loss"), grad_norm=data.get("grad_norm"),
            step_time_s=data.get("step_time_s"),
            rank_step_time_s=tuple(t for t in data.get("rank_step_time_s", ()) if t is not None),
            tokens_per_s=data.get("tokens_per_s"), time=data.get("time")))
    return tuple(rows)


def is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
