"""What one poll of the SSH executor costs (issue 37: a rank's death detected over SSH within 1 s needs polls
well under a second apart, so one poll must cost well under that). bench/fault_matrix.py uses both parts on its
2-node simulated cluster and prints them under its table:

timed_polls()   every NodeExecutor.poll of this process timed while the soaks run (the probe on every node over
                its persistent SSH connection, all nodes at once), and every run_command (each poll is followed by
                one on the first node, the metrics' last line; the monitors and the injected kill use it too): wall
                time, and the controller process's CPU time over the call (time.process_time: every thread,
                paramiko's transport threads included).
probe_cpu()     the probe's own CPU on a node (user + sys of `python3 -I -c PROBE poll ...`, from bash's `times`
                after a number of probes in a row), without sshd's share of opening the session.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from stepdeploy.remote.node_executor import PROBE, NodeExecutor
from stepdeploy.remote.ssh import Endpoint, connection

Sample = tuple[float, float]  # (wall s, controller CPU s) of one call
TIMED = ("poll", "run_command")  # run_command: each poll's metrics tail, the monitors' rounds, the injected kill


@contextlib.contextmanager
def timed_polls() -> Iterator[dict[str, list[Sample]]]:
    """Every NodeExecutor.poll and run_command (FabricExecutor's included) made inside the block, appended to the
    list of its name in the map yielded."""
    samples: dict[str, list[Sample]] = {name: [] for name in TIMED}
    originals = {name: getattr(NodeExecutor, name) for name in TIMED}

    def stopwatch(name: str) -> Callable[..., Any]:
        def timed(self: NodeExecutor, *args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return originals[name](self, *args, **kwargs)
            finally:
                samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))

        return timed

    for name in TIMED:  # a bench's stopwatch, put back below
        setattr(NodeExecutor, name, stopwatch(name))
    try:
        yield samples
    finally:
        for name, original in originals.items():
            setattr(NodeExecutor, name, original)


def summary(samples: list[Sample]) -> dict[str, Any]:
    """Median and p90 of the calls' wall time and the median controller CPU, in milliseconds."""
    if not samples:
        return {"calls": 0}
    walls = sorted(s[0] for s in samples)
    p90 = walls[min(len(walls) - 1, round(0.9 * (len(walls) - 1)))]
    return {"calls": len(samples), "wall_median_ms": round(statistics.median(walls) * 1000, 1),
            "wall_p90_ms": round(p90 * 1000, 1), "wall_max_ms": round(walls[-1] * 1000, 1),
            "cpu_median_ms": round(statistics.median(s[1] for s in samples) * 1000, 1)}


def probe_cpu(endpoint: Endpoint, count: int = 20) -> float:
    """Milliseconds of CPU (user + sys) one poll's probe takes on the node `endpoint` reaches (no run there: the
    probe reads the same /proc and files, and finds none of ours)."""
    probe = (f"{NodeExecutor.python} -I -c {shlex.quote(PROBE)} poll /nonexistent/stepdeploy-bench "
             "bench-run nodes/bench >/dev/null")
    with connection(endpoint) as conn:
        res = conn.run(f"for _ in $(seq {count}); do {probe}; done; times", hide=True)
    children = res.stdout.strip().splitlines()[-1]  # bash's `times`: the shell's line, then its children's
    seconds = [int(m) * 60 + float(s) for m, s in re.findall(r"(\d+)m([\d.]+)s", children)]
    return round(sum(seconds) / count * 1000, 1)
