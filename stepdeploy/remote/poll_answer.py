"""The node probe's poll answer (node_probe.py) -> one node's status, every part of it checked: the answer comes
from the node, and so does every rank's status and heartbeat file in it (stepdeploy/noderecords.py's schema).

A rank file that breaks the schema (`"rank": "x"`, a list instead of an object, NaN as a pid, a file over
MAX_RECORD_BYTES) is left out of the ranks and counted as the node's bad record, named in the node's detail and
in `NodeStatus.bad_records`: the node answered, so it is not "unreachable". Only an answer that is not the
probe's shape at all (not JSON, no state) is `BadAnswer`. Pure: text in, values out.
"""

from __future__ import annotations

import math
from typing import Any

from stepdeploy import noderecords
from stepdeploy.noderecords import BadRecord, Tally
from stepdeploy.remote.executor import EXITED, NOT_STARTED, RUNNING, NodeStatus, RankStatus

MAX_ANSWER_BYTES = 64 * 1024 * 1024  # the probe's whole answer (a few KiB per rank)
MAX_RECORD_BYTES = 64 * 1024  # one status or heartbeat file (node_probe.py reads one byte more)
MAX_PROCESSES = 100_000
STATES = (RUNNING, EXITED, NOT_STARTED)


class BadAnswer(ValueError):
    """The probe's answer is not its shape: the node (or its python3) is broken or hostile."""


def _answer(stdout: str) -> dict[str, Any]:
    if len(stdout) > MAX_ANSWER_BYTES:
        raise BadAnswer(f"the probe's answer is over {MAX_ANSWER_BYTES // (1024 * 1024)} MiB")
    lines = stdout.strip().splitlines()
    try:
        data = noderecords.loads(lines[-1] if lines else "", allow_nan=False, limit=MAX_ANSWER_BYTES)
    except BadRecord as exc:
        raise BadAnswer(f"the probe's answer is not its JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("state") not in STATES or not isinstance(data.get("ranks", []), list):
        raise BadAnswer("the probe's answer is not its shape (state, ranks)")
    return data


def _processes(value: Any) -> set[int]:
    if not isinstance(value, list):
        return set()
    return {v for v in value[:MAX_PROCESSES] if type(v) is int}


def _record(raw: Any, parse: Any, source: str, tally: Tally) -> Any:
    if raw is None:
        return None
    try:
        if not isinstance(raw, str):
            raise BadRecord("not text")
        if len(raw.encode("utf-8", "replace")) > MAX_RECORD_BYTES:
            raise BadRecord(f"longer than {MAX_RECORD_BYTES // 1024} KiB")
        return parse(raw)
    except BadRecord as exc:
        tally.note(source, str(exc))
        return None


def _file_rank(name: str) -> int | None:
    digits = name.removeprefix("rank").removesuffix(".json")
    return int(digits) if digits.isdigit() and len(digits) <= 7 else None


def _rank(entry: Any, node: str, here: str | None, live: set[int], now: float | None,
          tally: Tally) -> RankStatus | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
        tally.note("out/status", "an entry of the probe's answer that is not a rank file")
        return None
    name = entry["file"][:255]
    status = _record(entry.get("status"), noderecords.parse_status, f"out/status/{name}", tally)
    if status is None:
        return None
    if status.node not in (None, here):  # a shared run directory holds other nodes' ranks too
        return None
    rank = status.rank if status.rank is not None else _file_rank(name)
    if rank is None:
        tally.note(f"out/status/{name}", "no rank (neither in the file nor in its name)")
        return None
    beat = _record(entry.get("heartbeat"), noderecords.parse_heartbeat, f"out/heartbeat/rank{rank}", tally)
    state = "died" if status.state == RUNNING and status.pid not in live else status.state
    age = round(now - beat.time, 2) if beat is not None and now is not None else None
    return RankStatus(rank=rank, node=status.node or node, pid=status.pid, state=state, code=status.code,
                      reason=status.reason, iteration=beat.iteration if beat is not None else None,
                      heartbeat_age_s=age, failed_first_at=status.failed_first_at,
                      stopped_after_rank=status.stopped_after_rank)


def node_status(node: str, stdout: str) -> NodeStatus:
    """The probe's stdout on `node` -> its NodeStatus; BadAnswer when it is not the probe's answer at all."""
    data = _answer(stdout)
    tally = Tally()
    live = _processes(data.get("processes"))
    here = data.get("node") if isinstance(data.get("node"), str) else None
    now = data.get("now")
    now = float(now) if type(now) in (int, float) and math.isfinite(now) else None
    try:
        exit_code = noderecords.integer(data["exit_code"], noderecords.CODE_MIN, noderecords.CODE_MAX, "exit code") \
            if data.get("exit_code") is not None else None
    except BadRecord as exc:
        tally.note(f"nodes/{node}/exit_code", str(exc))
        exit_code = None
    found = [_rank(entry, node, here, live, now, tally) for entry in data.get("ranks", [])]
    ranks = tuple(sorted((r for r in found if r is not None), key=lambda r: r.rank))
    detail = f"{len(live)} process(es) of the run"
    if tally:
        detail += "; " + "; ".join(tally.describe())
    return NodeStatus(node, data["state"], exit_code, ranks, detail, bad_records=dict(tally.bad))


__all__ = ["BadAnswer", "node_status"]
