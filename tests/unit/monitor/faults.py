"""Recorded probe outputs (H200 x2) and injected-fault variants made from them by editing one section."""

from __future__ import annotations

import json
import re
from pathlib import Path

from stepdeploy.monitor import probe
from stepdeploy.monitor.model import NodeSample

FIXTURES = Path(__file__).parents[2] / "fixtures" / "monitor" / "h200-x2"
SHARED = Path(__file__).parents[2] / "fixtures" / "h200-x2"
SPEC = probe.ProbeSpec(run_dir="/nonexistent/run", checkpoint_dir="/tmp/stepdeploy-ckpt")
XID_79_GPU1 = ("[ 4711.123456] NVRM: Xid (PCI:0000:00:07): 79, pid='<unknown>', name=<unknown>, "
               "GPU has fallen off the bus.")
XID_13_GPU0 = ("[ 4712.000001] NVRM: Xid (PCI:0000:00:06): 13, pid=4242, name=python3, Graphics SM Warp "
               "Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address")


def recorded(number: int) -> str:
    return (FIXTURES / f"probe-sample-{number}.txt").read_text()


def section(output: str, name: str) -> str:
    return probe.split(output)[name][1]


def with_section(output: str, name: str, body: str, rc: int = 0) -> str:
    """The output with section `name` replaced (or added) with `body` and exit status `rc`."""
    block = f"{probe.MARK} begin {name}\n{body}\n{probe.MARK} end {name} {rc}\n"
    pattern = re.compile(rf"^{re.escape(probe.MARK)} begin {name}\n.*?^{re.escape(probe.MARK)} end {name} \d+\n",
                         re.MULTILINE | re.DOTALL)
    return pattern.sub(lambda _: block, output) if pattern.search(output) else output + block


def parse(output: str, node: str = "h200") -> NodeSample:
    return probe.parse(output, node, SPEC, now=0.0)


def _edit_gpu_line(output: str, index: int, edit) -> str:
    lines = section(output, "gpu").splitlines()
    out = []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        out.append(", ".join(edit(cells) if cells[0] == str(index) else cells))
    return with_section(output, "gpu", "\n".join(out))


def ecc_increment(output: str, index: int, by: int = 1) -> str:
    """GPU `index`: uncorrectable ECC volatile and aggregate totals + `by` (columns 7 and 8)."""
    def edit(cells: list[str]) -> list[str]:
        cells[7], cells[8] = str(int(cells[7]) + by), str(int(cells[8]) + by)
        return cells
    return _edit_gpu_line(output, index, edit)


def remap_pending(output: str, index: int) -> str:
    def edit(cells: list[str]) -> list[str]:
        cells[9] = "Yes"
        return cells
    return _edit_gpu_line(output, index, edit)


def add_kernel_lines(output: str, *lines: str) -> str:
    """Kernel log lines logged after the sample's mark; the mark moves to the last one."""
    old = [line for line in section(output, "kernel_log").splitlines() if not line.startswith("mark ")]
    stamp = re.match(r"\[\s*([\d.]+)\]", lines[-1]).group(1)
    return with_section(output, "kernel_log", "\n".join([*old, *lines, f"mark {stamp}"]))


def ib_text(states: dict[str, str], counters: dict[str, dict[str, int]] | None = None) -> str:
    """sysfs as `grep -H .` prints it from /sys/class/infiniband, for ports named "mlx5_0/1"."""
    lines = []
    for name, state in states.items():
        dev, port = name.split("/")
        phys = "5: LinkUp" if "ACTIVE" in state else "3: Disabled"
        lines += [f"{dev}/ports/{port}/state:{state}", f"{dev}/ports/{port}/phys_state:{phys}"]
        for counter, value in (counters or {}).get(name, {}).items():
            group = "hw_counters" if counter in ("local_ack_timeout_err", "packet_seq_err") else "counters"
            lines.append(f"{dev}/ports/{port}/{group}/{counter}:{value}")
    return "\n".join(lines)


def set_operstate(output: str, iface: str, state: str) -> str:
    body = re.sub(rf"^{re.escape(iface)}/operstate:.*$", f"{iface}/operstate:{state}", section(output, "net"),
                  flags=re.MULTILINE)
    return with_section(output, "net", body)


def clock(output: str, seconds: float) -> str:
    return with_section(output, "clock", f"{seconds:.6f}")


def heartbeats(beats: dict[int, tuple[int, float]]) -> str:
    """rank -> (iteration, time), as the probe prints out/heartbeat/rank<R>."""
    return "\n".join(f"rank{r} " + json.dumps({"iteration": it, "pid": 1000 + r, "time": t})
                     for r, (it, t) in sorted(beats.items()))


def statuses(states: dict[int, str]) -> str:
    return "\n".join(f"rank{r}.json " + json.dumps({"rank": r, "state": s, "pid": 1000 + r, "node": "h200"})
                     for r, s in sorted(states.items()))


def metrics(rows: list[tuple[int, float, float, list[float]]]) -> str:
    """(iteration, loss, grad_norm, rank step times) -> metrics.jsonl lines (json.dumps writes NaN as NaN)."""
    return "\n".join(json.dumps({"iteration": it, "loss": loss, "grad_norm": gn, "rank_step_time_s": times,
                                 "time": 1000.0 + it}) for it, loss, gn, times in rows)


def steady_rows(count: int, start: int = 1, world: int = 4) -> list[tuple[int, float, float, list[float]]]:
    """A loss slowly falling around 2.5 with a little noise, grad norms ~1, equal rank step times."""
    return [(i, 2.5 - 0.005 * i + (0.02 if i % 3 else -0.02), 1.0 + 0.1 * (i % 2),
             [0.50 + 0.01 * ((i + r) % 2) for r in range(world)]) for i in range(start, start + count)]
