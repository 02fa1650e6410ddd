"""The collector's probe: one shell command per node that prints every reading as a framed section, and
the parser that turns its output into a NodeSample. Pure: text in, text/values out (the SSH side that runs
`remote_command()` every few seconds lives with the executor).

Every section runs under `timeout`, so an nvidia-smi stuck on a broken GPU costs its own section, not the
sample; every path and interface name is shell-quoted.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from stepdeploy.monitor import parse_gpu, parse_host, parse_workload
from stepdeploy.monitor.model import NodeSample
from stepdeploy.noderecords import Tally
from stepdeploy.remote import sections

MARK = "@@stepdeploy-monitor@@"
NO_TOOL_RC = 127  # nvidia-smi absent: a CPU node, not an error
OPTIONAL_SECTIONS = ("procs",)  # a hint (which stuck rank is stopped); outputs recorded before it lack it


@dataclass(frozen=True)
class ProbeSpec:
    """What each sample reads. `run_dir`: the rendered run on the node (None: no workload files)."""

    run_dir: str | None = None
    checkpoint_dir: str = "/"
    ifaces: tuple[str, ...] = ()  # netdevs to read; () = every interface
    gpu_fields: tuple[str, ...] = parse_gpu.GPU_QUERY_FIELDS
    metrics_tail: int = 200
    xid_tail: int = 200
    section_timeout_s: int = 10


def _kernel_log(spec: ProbeSpec) -> str:
    # One dmesg read: the XID lines, then the last line's timestamp as the "seen up to" mark.
    return ("log=$(dmesg 2>/dev/null) || { echo 'cannot read the kernel log (dmesg)'; exit 3; }; "
            f"printf '%s\\n' \"$log\" | grep -E 'NVRM: Xid' | tail -n {int(spec.xid_tail)}; "
            "printf '%s\\n' \"$log\" | tail -n 1 | sed -n 's/^\\[ *\\([0-9.]*\\)\\].*/mark \\1/p'")


def _net(spec: ProbeSpec) -> str:
    names = [shlex.quote(i) for i in spec.ifaces] or ["*"]
    files = " ".join(f"{n}/operstate {n}/carrier_down_count {n}/statistics/*" for n in names)
    return f"cd /sys/class/net && grep -s -H . {files}; exit 0"


def _rank_files(directory: str) -> str:
    return (f"cd {shlex.quote(directory)} 2>/dev/null || exit 0; for f in rank*; do [ -f \"$f\" ] && "
            "printf '%s %s\\n' \"$f\" \"$(tr -d '\\n' < \"$f\")\"; done; exit 0")


def _proc_states(directory: str) -> str:
    # Each rank's process state (R, S, D, T...): a SIGSTOPped (T) or uninterruptible (D) rank among ranks
    # whose heartbeats all stopped is the stuck one; its peers sleep (S) in their collectives.
    return (f"cd {shlex.quote(directory)} 2>/dev/null || exit 0; for f in rank*.json; do "
            "pid=$(sed -n 's/.*\"pid\": *\\([0-9][0-9]*\\).*/\\1/p' \"$f\"); "
            "[ -n \"$pid\" ] && [ -r /proc/$pid/stat ] && "
            "printf '%s %s %s\\n' \"${f%.json}\" \"$pid\" \"$(sed 's/.*) //' /proc/$pid/stat | cut -d' ' -f1)\"; "
            "done; exit 0")


def commands(spec: ProbeSpec) -> dict[str, str]:
    """Section name -> POSIX shell command."""
    ckpt = shlex.quote(spec.checkpoint_dir)
    out = {
        "clock": "date +%s.%N",
        "gpu": f"command -v nvidia-smi >/dev/null || exit {NO_TOOL_RC}; {parse_gpu.query_command(spec.gpu_fields)}",
        "kernel_log": _kernel_log(spec),
        "ib": ("cd /sys/class/infiniband 2>/dev/null || exit 0; grep -s -H . */ports/*/state */ports/*/phys_state "
               "*/ports/*/counters/* */ports/*/hw_counters/*; exit 0"),
        "net": _net(spec),
        "meminfo": "cat /proc/meminfo",
        "disk": f"d={ckpt}; while [ ! -e \"$d\" ]; do d=$(dirname \"$d\"); done; echo \"$d\"; df -P -k \"$d\"",
    }
    if spec.run_dir:
        run = spec.run_dir.rstrip("/")
        out["heartbeats"] = _rank_files(f"{run}/out/heartbeat")
        out["statuses"] = _rank_files(f"{run}/out/status")
        out["procs"] = _proc_states(f"{run}/out/status")
        metrics = shlex.quote(f"{run}/out/metrics.jsonl")
        out["metrics"] = f"tail -n {int(spec.metrics_tail)} {metrics} 2>/dev/null; exit 0"
    return out


def script(spec: ProbeSpec) -> str:
    return sections.script(MARK, commands(spec), spec.section_timeout_s)


def remote_command(spec: ProbeSpec) -> str:
    """The single command to run on a node."""
    return sections.remote_command(script(spec))


def split(output: str) -> dict[str, tuple[int, str]]:
    """Probe output -> {section: (rc, text)}. A section cut off (the node died mid-probe) is absent."""
    return sections.split(MARK, output)


def _clock(text: str, fallback: float) -> float:
    match = re.match(r"\s*(\d+(\.\d+)?)", text)  # busybox date prints a literal %N: keep the seconds
    return float(match.group(1)) if match else fallback


def _why(rc: int, text: str) -> str:
    tail = text.strip()[-300:]
    return f"timed out ({tail})" if rc == 124 else f"exit {rc}: {tail}" if tail else f"exit {rc}"


def _parse_gpu(rc: int, text: str, spec: ProbeSpec) -> dict:
    if rc == NO_TOOL_RC:
        return {}
    if rc != 0:
        return {"errors": {"gpu": _why(rc, text)}}
    try:
        return {"gpus": parse_gpu.parse_query_csv(text, spec.gpu_fields)}
    except ValueError as exc:
        return {"errors": {"gpu": str(exc)}}


def _parse_kernel_log(rc: int, text: str, spec: ProbeSpec) -> dict:
    if rc != 0:
        return {"errors": {"kernel_log": _why(rc, text)}}
    marks = [float(m.group(1)) for m in re.finditer(r"^mark (\d+(?:\.\d+)?)$", text, re.MULTILINE)]
    return {"xids": parse_gpu.parse_xids(text), "kernel_mark_s": marks[-1] if marks else None}


def _simple(key: str, parse: Callable[[str], object]) -> Callable[[int, str, ProbeSpec], dict]:
    def handle(rc: int, text: str, spec: ProbeSpec) -> dict:
        return {key: parse(text)} if rc == 0 else {"errors": {key: _why(rc, text)}}
    return handle


def _workload(key: str, parse: Callable[[str, Tally], object]) -> Callable[[int, str, ProbeSpec], dict]:
    """A workload file's section: its valid records, and the node's bad records as this section's error."""
    def handle(rc: int, text: str, spec: ProbeSpec) -> dict:
        if rc != 0:
            return {"errors": {key: _why(rc, text)}}
        tally = Tally()
        values = {key: parse(text, tally)}
        return {**values, "errors": {key: "; ".join(tally.describe())}} if tally else values
    return handle


_PARSERS: dict[str, Callable[[int, str, ProbeSpec], dict]] = {
    "gpu": _parse_gpu, "kernel_log": _parse_kernel_log,
    "ib": _simple("ib_ports", parse_host.parse_ib), "net": _simple("netdevs", parse_host.parse_netdevs),
    "meminfo": _simple("meminfo_kib", parse_host.parse_meminfo), "disk": _simple("disk", parse_host.parse_df),
    "heartbeats": _workload("heartbeats", parse_workload.parse_heartbeats),
    "statuses": _workload("ranks", parse_workload.parse_statuses),
    "metrics": _workload("metrics", parse_workload.parse_metrics),
    "procs": _simple("rank_proc_states", parse_workload.parse_proc_states),
}


def parse(output: str, node: str, spec: ProbeSpec, now: float) -> NodeSample:
    """The probe's output -> one NodeSample. `now`: the controller's clock, used when the node's is missing."""
    sections = split(output)
    values: dict = {"errors": {}}
    for name in commands(spec):
        if name == "clock":
            continue
        if name not in sections:
            if name not in OPTIONAL_SECTIONS:
                values["errors"][name] = "section missing from the probe output (cut off?)"
            continue
        rc, text = sections[name]
        for key, value in _PARSERS[name](rc, text, spec).items():
            if key == "errors":
                values["errors"][name] = "; ".join(value.values())
            else:
                values[key] = value
    rc, text = sections.get("clock", (1, ""))
    return NodeSample(node=node, time=_clock(text, now) if rc == 0 else now, **values)
