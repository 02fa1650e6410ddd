"""The workload's own files (stepdeploy/workload/metrics.py): heartbeats, status files, metrics.jsonl.

The probe prints heartbeats and status files one per line as `<file name> <json>`, and the tail of
metrics.jsonl as it is. A line that is not JSON (a file caught mid-rewrite is impossible: they are written
atomically, but a metrics line can be cut by `tail`) is skipped, never fatal. Pure: text in, values out.
"""

from __future__ import annotations

import json
import math
import re

from stepdeploy.monitor.model import Heartbeat, MetricsRow, RankFile

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

_RANK = re.compile(r"rank(\d+)")


def _json_lines(text: str) -> list[tuple[int, dict]]:
    out = []
    for line in text.splitlines():
        name, _, body = line.strip().partition(" ")
        match = _RANK.search(name)
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            continue
        if match and isinstance(data, dict):
            out.append((int(match.group(1)), data))
    return out


def _opt_int(value: object) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _opt_float(value: object) -> float | None:
    """JSON numbers; json.dumps writes NaN/Infinity as bare words, which json.loads reads back as floats."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def parse_heartbeats(text: str) -> tuple[Heartbeat, ...]:
    beats = [Heartbeat(rank=rank, iteration=_opt_int(d.get("iteration")), time=float(d["time"]),
                       pid=_opt_int(d.get("pid")))
             for rank, d in _json_lines(text) if _opt_float(d.get("time")) is not None]
    return tuple(sorted(beats, key=lambda b: b.rank))


def parse_statuses(text: str) -> tuple[RankFile, ...]:
    files = [RankFile(rank=_opt_int(d.get("rank")) if d.get("rank") is not None else rank,  # type: ignore[arg-type]
                      state=str(d.get("state", "")), pid=_opt_int(d.get("pid")), node=d.get("node"),
                      code=_opt_int(d.get("code")), reason=str(d.get("reason") or ""))
             for rank, d in _json_lines(text)]
    return tuple(sorted(files, key=lambda f: f.rank))


def parse_proc_states(text: str) -> dict[int, str]:
    """`rank<R> <pid> <state>` lines -> {rank: state letter from /proc/<pid>/stat}."""
    states = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].startswith("rank") and parts[0][4:].isdigit():
            states[int(parts[0][4:])] = parts[2]
    return states


def parse_metrics(text: str) -> tuple[MetricsRow, ...]:
    rows = []
    for line in text.splitlines():
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(data, dict) or _opt_int(data.get("iteration")) is None:
            continue
        times = data.get("rank_step_time_s") or ()
        rows.append(MetricsRow(
            iteration=int(data["iteration"]), loss=_opt_float(data.get("loss")),
            grad_norm=_opt_float(data.get("grad_norm")), step_time_s=_opt_float(data.get("step_time_s")),
            rank_step_time_s=tuple(float(t) for t in times if _opt_float(t) is not None),
            tokens_per_s=_opt_float(data.get("tokens_per_s")), time=_opt_float(data.get("time"))))
    return tuple(rows)


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
