"""Records a node writes, read as untrusted input: the one schema for every metrics and phases line, status and
heartbeat file, and the probe's answer, with bounds. A node is root on its own machine only; nothing it writes
may crash, hang or exhaust the controller.

Every record is one JSON document of at most MAX_LINE_BYTES, decoded from UTF-8 with replacement characters,
nesting at most MAX_DEPTH levels. Figures are checked: iterations 0..1e9, ranks 0..1e6, pids 1..2**22, exit
codes -255..255, times finite and within [0, 1e10] (year 2286), durations within [0, 1e7] s. A record that
breaks a rule is `BadRecord` (its reason says which rule); readers skip it and count it in a `Tally`, per file,
as the node's fault. Known keys are typed; unknown keys are kept as bounded extras (nesting bounded,
NaN/Infinity in them become null), so a workload that writes a new figure is not cut off.

NaN and Infinity: the workload writes a NaN loss as the bare word NaN (json.dumps), and a NaN loss must reach
the loss gate and the monitor (it fails them). So in a metrics line the measured figures (loss, grad norm, ...)
may be NaN or infinite; every other field of every record must be finite, and status, heartbeat and phases
records refuse the bare words outright (`parse_constant`). Pure: text in, values out; the file reader is the
one function that touches the disk.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepdeploy.safeio import nesting

MAX_LINE_BYTES = 1024 * 1024  # a metrics line with every rank's step time (rank_step_time_s) of ~50k ranks
MAX_DEPTH = 8  # levels of lists/objects in one record (the workload writes 3 at most)
MAX_KEY_CHARS = 128
MAX_TEXT_CHARS = 4096  # a status file's reason (the workload cuts it at 2000), a phase name, a host name
MAX_LIST = 1_000_000  # entries of rank_step_time_s (one per rank)
ITERATION_MAX = 1_000_000_000
RANK_MAX = 1_000_000
PID_MAX = 4_194_304  # Linux's highest pid_max
CODE_MIN, CODE_MAX = -255, 255
TIME_MAX = 1e10  # seconds since 1970: year 2286
DURATION_MAX = 1e7  # seconds: 115 days

# metrics fields the gates and the monitors judge: a number, NaN and infinities included (a NaN loss fails them)
MEASURED = frozenset(("loss", "grad_norm", "lr", "tokens_per_s", "mem_allocated_gib", "mem_reserved_gib",
                      "mem_peak_gib", "mfu", "moe_load_max", "moe_dropped", "router_bias_absmax",
                      "moe_aux_loss_mean", "moe_load_ceiling"))
DURATIONS = frozenset(("step_time_s", "forward_backward_s", "optimizer_s"))
PER_LAYER = frozenset(("moe_load", "router_bias", "moe_aux_loss"))  # {layer: number}
PHASE_DURATIONS = frozenset(("step_s", "load_s", "blocking_s", "background_s", "commit_s", "seconds",
                             "setup_wait_s"))


class BadRecord(ValueError):
    """A record that breaks the schema; str() says which rule."""


def _refuse_constant(name: str) -> float:
    raise BadRecord(f"holds {name}, which is not a JSON number")


_LENIENT = json.JSONDecoder()  # NaN/Infinity read as floats: metrics lines (measured figures may be NaN)
_STRICT = json.JSONDecoder(parse_constant=_refuse_constant)


# --- parsing ------------------------------------------------------------------------------------------------


def loads(text: str | bytes, *, allow_nan: bool = False, limit: int = MAX_LINE_BYTES) -> Any:
    """One JSON document of at most `limit` characters nesting at most MAX_DEPTH levels; BadRecord otherwise.
    Bytes are decoded as UTF-8 with replacement characters."""
    if len(text) > limit:
        raise BadRecord(f"longer than {limit // 1024} KiB")
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        value = (_LENIENT if allow_nan else _STRICT).decode(text)
    except RecursionError:
        raise BadRecord(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise BadRecord(str(exc) if isinstance(exc, BadRecord) else f"not JSON ({exc.args[0][:80]})") from None
    # a text with fewer brackets than MAX_DEPTH cannot nest deeper: most records skip the walk
    brackets = text.count("[") + text.count("{")
    if isinstance(value, dict | list) and brackets > MAX_DEPTH and nesting(value, MAX_DEPTH) > MAX_DEPTH:
        raise BadRecord(f"nested deeper than {MAX_DEPTH} levels")
    return value


# --- fields -------------------------------------------------------------------------------------------------


_NUMBER_TYPES = frozenset((int, float))  # what json decodes a number to (bool excluded: type(True) is bool)


def _is_number(value: Any) -> bool:
    return type(value) in _NUMBER_TYPES


def integer(value: Any, low: int, high: int, name: str) -> int:
    """A JSON integer (or a float with an integral value) in low..high; BadRecord otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        number = int(value)
    else:
        raise BadRecord(f"{name} is not an integer ({_show(value)})")
    if not low <= number <= high:
        raise BadRecord(f"{name} {number} is outside {low}..{high:g}")
    return number


def finite(value: Any, low: float, high: float, name: str) -> float:
    if not _is_number(value) or not math.isfinite(value) or not low <= value <= high:
        raise BadRecord(f"{name} is not a number in {low:g}..{high:g} ({_show(value)})")
    return float(value)


def text(value: Any, name: str, limit: int = MAX_TEXT_CHARS) -> str:
    if not isinstance(value, str):
        raise BadRecord(f"{name} is not text ({_show(value)})")
    return value[:limit]


def _optional(check: Callable[..., Any], value: Any, *args: Any) -> Any:
    return None if value is None else check(value, *args)


def _show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def extra(value: Any) -> Any:
    """An unknown key's value: kept (the line bounds its size, loads() its nesting); NaN/infinities -> None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k)[:MAX_KEY_CHARS]: extra(v) for k, v in value.items()}
    if isinstance(value, list):
        return [extra(v) for v in value]
    return value


def _measured(value: Any) -> float | None:
    return float(value) if type(value) in _NUMBER_TYPES else None


def _duration(value: Any) -> float | None:
    return float(value) if type(value) in _NUMBER_TYPES and 0 <= value <= DURATION_MAX else None  # NaN fails


def _per_rank(value: Any) -> list[float | None] | None:
    if not isinstance(value, list) or len(value) > MAX_LIST:
        return None
    return [float(v) if type(v) in _NUMBER_TYPES and 0 <= v <= DURATION_MAX else None for v in value]


def _per_layer(value: Any) -> dict[str, float] | None:
    if not isinstance(value, dict):
        return None
    return {str(k)[:MAX_KEY_CHARS]: float(v) for k, v in value.items() if type(v) in _NUMBER_TYPES}


def _mtp(value: Any) -> list[float | None] | None:
    return [_measured(v) for v in value] if isinstance(value, list) else None


def _metric_time(value: Any) -> float:
    return finite(value, 0.0, TIME_MAX, "time")


# metrics key -> its check: a value, or None to drop the key (time: BadRecord drops the line)
_METRIC_FIELDS: dict[str, Callable[[Any], Any]] = {
    "time": _metric_time, "rank_step_time_s": _per_rank, "mtp_loss": _mtp,
    **{key: _measured for key in MEASURED}, **{key: _duration for key in DURATIONS},
    **{key: _per_layer for key in PER_LAYER}}


# --- records ------------------------------------------------------------------------------------------------


def metrics_record(data: Any) -> dict[str, Any]:
    """One metrics line: iteration required; `time`, when given, a time; measured figures a number (NaN
    included) or dropped; durations finite or dropped; per-rank and per-layer figures kept by position/name."""
    if not isinstance(data, dict):
        raise BadRecord(f"not a JSON object ({type(data).__name__})")
    out: dict[str, Any] = {"iteration": integer(data.get("iteration"), 0, ITERATION_MAX, "iteration")}
    for key, value in data.items():
        if value is None or key == "iteration" or len(key) > MAX_KEY_CHARS:
            continue
        check = _METRIC_FIELDS.get(key)
        if check is None:
            out[key] = extra(value)
        elif (checked := check(value)) is not None:
            out[key] = checked
    return out


def phase_record(data: Any) -> dict[str, Any]:
    """One phases.jsonl line: `phase` (text) and `time` required; pid, iteration, began and durations typed."""
    if not isinstance(data, dict):
        raise BadRecord(f"not a JSON object ({type(data).__name__})")
    out: dict[str, Any] = {"phase": text(data.get("phase"), "phase", 64),
                           "time": finite(data.get("time"), 0.0, TIME_MAX, "time")}
    for key, value in data.items():
        if key in ("phase", "time") or len(key) > MAX_KEY_CHARS:
            continue
        if value is None:
            out[key] = None
        elif key == "pid":
            out[key] = integer(value, 1, PID_MAX, "pid")
        elif key == "iteration":
            out[key] = integer(value, 0, ITERATION_MAX, "iteration")
        elif key == "began":
            out[key] = finite(value, 0.0, TIME_MAX, "began")
        elif key in PHASE_DURATIONS:
            out[key] = finite(value, 0.0, DURATION_MAX, key)
        else:
            out[key] = extra(value)
    return out


@dataclass(frozen=True)
class StatusRecord:
    """A rank's status file (out/status/rank<R>.json); the last two fields are its launcher's (launch_ranks.py)."""

    rank: int | None
    state: str
    pid: int | None = None
    node: str | None = None
    code: int | None = None
    reason: str = ""
    failed_first_at: float | None = None  # when the launcher saw this rank fail, the first of its node
    stopped_after_rank: int | None = None  # the launcher stopped this rank after that rank failed


@dataclass(frozen=True)
class HeartbeatRecord:
    """A rank's heartbeat file (out/heartbeat/rank<R>)."""

    time: float
    iteration: int | None = None
    pid: int | None = None
    state: str | None = None


def status_record(data: Any) -> StatusRecord:
    if not isinstance(data, dict):
        raise BadRecord(f"not a JSON object ({type(data).__name__})")
    return StatusRecord(rank=_optional(integer, data.get("rank"), 0, RANK_MAX, "rank"),
                        state=text(data.get("state", ""), "state", 32),
                        pid=_optional(integer, data.get("pid"), 1, PID_MAX, "pid"),
                        node=_optional(text, data.get("node"), "node", 255),
                        code=_optional(integer, data.get("code"), CODE_MIN, CODE_MAX, "code"),
                        reason=_optional(text, data.get("reason"), "reason") or "",
                        failed_first_at=_optional(finite, data.get("failed_first_at"), 0.0, TIME_MAX,
                                                  "failed_first_at"),
                        stopped_after_rank=_optional(integer, data.get("stopped_after_rank"), 0, RANK_MAX,
                                                     "stopped_after_rank"))


def heartbeat_record(data: Any) -> HeartbeatRecord:
    if not isinstance(data, dict):
        raise BadRecord(f"not a JSON object ({type(data).__name__})")
    return HeartbeatRecord(time=finite(data.get("time"), 0.0, TIME_MAX, "time"),
                           iteration=_optional(integer, data.get("iteration"), 0, ITERATION_MAX, "iteration"),
                           pid=_optional(integer, data.get("pid"), 1, PID_MAX, "pid"),
                           state=_optional(text, data.get("state"), "state", 32))


def parse_status(raw: str | bytes) -> StatusRecord:
    return status_record(loads(raw))


def parse_heartbeat(raw: str | bytes) -> HeartbeatRecord:
    return heartbeat_record(loads(raw))


# --- counting the node's faults ---------------------------------------------------------------------------


@dataclass
class Tally:
    """Bad records per file (or section), with the first reason of each: the node's fault, for a warning or
    a ledger event."""

    bad: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # read, but not as written (invalid UTF-8 replaced)

    def note(self, source: str, reason: str) -> None:
        self.bad[source] = self.bad.get(source, 0) + 1
        self.first.setdefault(source, reason[:300])

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def __bool__(self) -> bool:
        return bool(self.bad or self.warnings)

    def describe(self) -> list[str]:
        return [*(f"{source}: {count} bad record(s) from the node, skipped (first: {self.first[source]})"
                  for source, count in sorted(self.bad.items())), *self.warnings]


def parse_lines(text_or_lines: str | list[str], parse: Callable[[Any], Any], source: str, tally: Tally,
                *, allow_nan: bool = False) -> list[Any]:
    """Every valid record of a JSON-lines text; the others are counted in `tally` under `source`. A last line
    without its newline (cut by `tail` or a kill) is read like the others."""
    lines = text_or_lines.splitlines() if isinstance(text_or_lines, str) else text_or_lines
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(parse(loads(line, allow_nan=allow_nan)))
        except BadRecord as exc:
            tally.note(source, f"line {number}: {exc}")
    return records


# --- files --------------------------------------------------------------------------------------------------


def file_lines(path: Path, source: str, tally: Tally) -> Iterator[str]:
    """The lines of a fetched file, decoded as UTF-8 with replacement characters (a warning in `tally` says so). Only a
    regular file is read (no FIFO, no link); a line over MAX_LINE_BYTES is counted bad and skipped unread."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        tally.note(source, f"cannot open it: {exc.strerror or exc}")
        return
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            tally.note(source, "not a regular file")
            return
        replaced = False
        for number, raw in enumerate(_bounded_lines(handle), 1):
            if raw is None:
                tally.note(source, f"line {number}: longer than {MAX_LINE_BYTES // 1024} KiB")
                continue
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                replaced = True
                yield raw.decode("utf-8", "replace")
        if replaced:
            tally.warn(f"{source}: not UTF-8; read with replacement characters")


def _bounded_lines(handle: Any) -> Iterator[bytes | None]:
    """Lines (newline stripped) of at most MAX_LINE_BYTES; None for each longer line (never held whole)."""
    while True:
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (more := handle.readline(MAX_LINE_BYTES)) and not more.endswith(b"\n"):
                pass
            yield None
            continue
        yield line.rstrip(b"\n")


__all__ = ["BadRecord", "HeartbeatRecord", "StatusRecord", "Tally", "file_lines", "heartbeat_record", "loads",
           "metrics_record", "parse_heartbeat", "parse_lines", "parse_status", "phase_record", "status_record"]
