"""`stepdeploy report` of a 72-hour soak (issue 36 item 3): a ledger written through stepdeploy's own Ledger API with
what such a soak records, then `report RUN` and `report RUN --html FILE` timed in a subprocess each, with the
CPU time and peak RSS of each (os.wait4's rusage of that child: what resource.getrusage(RUSAGE_CHILDREN)
reports, per child).

The run `soak72h`: a warmup (50 iterations) and one scale rung (50), then a soak of --iterations iterations over
72 hours in --restarts + 1 attempts (each restart resumes from the last checkpoint, every 500 iterations, and
redoes what followed it). Every iteration records the scalars (loss, grad_norm, lr, step_time_s, tokens_per_s,
mfu, moe_load_max, moe_dropped, router_bias_absmax, mem_allocated/reserved/peak_gib), rank_step_time_s of each of
--ranks ranks, and per MoE layer moe_load/<layer> and router_bias/<layer> (--layers layers); --events monitor
findings (kind `monitor`, as rollout/monitors.py writes them) are spread over the soak, and its goodput event
closes it.

    .venv/bin/python bench/report_scale.py                          # 400,000 iterations: ~42 M metric rows
    .venv/bin/python bench/report_scale.py --iterations 20000 --dir /tmp/soak20k   # kept (and reused) there
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stepdeploy.ledger import Ledger  # noqa: E402

RUN = "soak72h"
T0 = 1_780_000_000.0
SOAK_S = 72 * 3600.0
CHECKPOINT_EVERY = 500
SCALARS = ("loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu", "moe_load_max", "moe_dropped",
           "router_bias_absmax", "mem_allocated_gib", "mem_reserved_gib", "mem_peak_gib")
CHUNK = 1000  # iterations per add_metrics call (one transaction)


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


def step_rows(ts: float, it: int, total: int, ranks: int, layers: int, rng: random.Random
              ) -> list[tuple[float, int, int, str, float]]:
    """What one iteration records (attempt.py's metric_rows: scalars on rank 0, step time per rank, per layer)."""
    progress = it / total
    step = 0.6 + rng.random() * 0.02
    rank_times = [step - rng.random() * 0.01 for _ in range(ranks)]
    values = (2.0 + 6.0 * math.exp(-6 * progress) + rng.gauss(0, 0.05), 0.3 + rng.random() * 0.4 + (it % 9973 == 0),
              3e-4 * 0.5 * (1 + math.cos(math.pi * progress)), step, 2.9e6 / step, 0.42 + rng.gauss(0, 0.005),
              1.3 + rng.random() * 0.4, 0.0, 0.05 + 0.1 * progress, 61.0 + rng.random(), 70.0, 74.5 + rng.random())
    rows = [(ts, 0, it, name, value) for name, value in zip(SCALARS, values, strict=True)]
    rows += [(ts, rank, it, "rank_step_time_s", value) for rank, value in enumerate(rank_times)]
    rows += [(ts, 0, it, f"moe_load/{layer}", 1.0 + rng.random() * 0.6) for layer in range(3, 3 + layers)]
    rows += [(ts, 0, it, f"router_bias/{layer}", 0.1 * progress + rng.random() * 0.01)
             for layer in range(3, 3 + layers)]
    return rows


def record_steps(led: Ledger, clock: Clock, attempt: int, first: int, last: int, total: int, step_s: float,
                 ranks: int, layers: int, rng: random.Random) -> None:
    for start in range(first, last + 1, CHUNK):
        rows: list[tuple[float, int, int, str, float]] = []
        for it in range(start, min(start + CHUNK, last + 1)):
            clock.t += step_s
            rows += step_rows(clock.t, it, total, ranks, layers, rng)
        led.add_metrics(RUN, attempt, rows)


def short_stage(led: Ledger, clock: Clock, stage: str, rung: str, args: argparse.Namespace,
                rng: random.Random) -> None:
    led.add_rungs(RUN, stage, [(rung, {"nodes": 2})])
    led.set_stage(RUN, stage, "running")
    attempt = led.start_attempt(RUN, stage, rung, {"rung": rung, "nodes": 2, "model": "moe-45"})
    record_steps(led, clock, attempt, 1, 50, 400_000, 0.65, args.ranks, args.layers, rng)
    led.finish_attempt(attempt, "passed")
    led.verdict(RUN, stage, rung, "loss_finite", True, measured=7.9, threshold=None, reason="finite")
    led.set_rung(RUN, stage, rung, "passed")
    led.set_stage(RUN, stage, "passed")


def soak(led: Ledger, clock: Clock, args: argparse.Namespace, rng: random.Random) -> None:
    """--iterations rows of iterations in --restarts + 1 attempts, --events monitor findings spread over them."""
    led.add_rungs(RUN, "soak", [("target", {"nodes": 2, "duration_s": SOAK_S})])
    led.set_stage(RUN, "soak", "running")
    attempts = args.restarts + 1
    step_s = SOAK_S * 0.95 / args.iterations
    per_attempt = args.iterations // attempts
    events_per_attempt = [args.events // attempts + (i < args.events % attempts) for i in range(attempts)]
    resume, started = 1, clock.t
    for n in range(attempts):
        count = per_attempt + (args.iterations % attempts if n == attempts - 1 else 0)
        detail = {"rung": "target", "nodes": 2, "model": "moe-45"}
        if n:
            detail["restored_from"] = f"iter_{resume - 1:07d}"
        attempt = led.start_attempt(RUN, "soak", "target", detail)
        before = clock.t
        record_steps(led, clock, attempt, resume, resume + count - 1, args.iterations, step_s, args.ranks,
                     args.layers, rng)
        monitor_events(led, before, clock.t, events_per_attempt[n], rng)
        clock.t += 1
        if n == attempts - 1:
            led.finish_attempt(attempt, "passed")
            break
        led.event(RUN, "failure", f"rank {rng.randrange(args.ranks)} exited -9", stage="soak", data={"attempt": n})
        led.finish_attempt(attempt, "failed", {"exit": {"node2": -9}})
        clock.t += 60
        led.event(RUN, "restart", "restarting the soak from its last checkpoint", stage="soak")
        reached = resume + count - 1
        resume = max(1, reached - reached % CHECKPOINT_EVERY + 1) if reached >= CHECKPOINT_EVERY else 1
    led.event(RUN, "goodput", "goodput 0.93", stage="soak", data=goodput(clock.t - started, attempts, args))
    led.verdict(RUN, "soak", "target", "no_unrecovered_failure", True, measured={"failures": args.restarts},
                threshold={"unrecovered": 0}, reason=f"{args.restarts} failure(s), each recovered")
    led.set_rung(RUN, "soak", "target", "passed")
    led.set_stage(RUN, "soak", "passed")


def monitor_events(led: Ledger, start: float, end: float, count: int, rng: random.Random) -> None:
    """Findings as rollout/monitors.py records them (severity: node subject: message, the finding's JSON)."""
    now = led.clock
    for i in range(count):
        assert isinstance(now, Clock)
        saved, now.t = now.t, start + (end - start) * (i + 0.5) / count
        node, gpu = f"node{rng.randrange(1, 3)}", rng.randrange(8)
        led.event(RUN, "monitor", f"warning: {node} gpu{gpu}: temperature {84 + rng.random() * 4:.1f} C above 83 C",
                  stage="soak", rung="target", data={"kind": "gpu_temp", "severity": "warning",
                                                     "subject": f"gpu{gpu}", "node": node})
        now.t = saved


def goodput(wall: float, attempts: int, args: argparse.Namespace) -> dict[str, Any]:
    parts = {"productive": wall * 0.93, "startup": wall * 0.03, "checkpoint": wall * 0.02, "failures": wall * 0.01,
             "redone": wall * 0.005, "other": wall * 0.005}
    return {"ratio": 0.93, "wall_s": wall, "steady_step_s": 0.61, "max_save_s": 41.0, "overrun_s": None,
            "iterations": args.iterations, "saves": args.iterations // CHECKPOINT_EVERY, "redone": args.restarts * 250,
            "starts": [{"attempt": i} for i in range(attempts)], "failures": [{"n": i} for i in range(args.restarts)],
            "parts": parts, "shares": {k: v / wall for k, v in parts.items()},
            "startup_parts": {"launch": 100.0, "model_build": 900.0, "checkpoint_load": 3000.0},
            "failure_parts": {"detection": 900.0, "stop": 300.0, "restart": 600.0}}


def build(run_dir: Path, args: argparse.Namespace) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    clock, rng = Clock(), random.Random(36)
    led = Ledger(run_dir / "ledger.sqlite", clock=clock)
    # a benchmark's scratch ledger: no fsync per commit (the ledger's FULL survives a power cut, not needed here)
    led.db.execute("PRAGMA synchronous=OFF")
    try:
        led.create_run(RUN, {"model": "moe-45", "layers": args.layers, "stages": ["warmup", "scale", "soak"]},
                       ["warmup", "scale", "soak"])
        led.set_run_status(RUN, "running")
        short_stage(led, clock, "warmup", "target", args, rng)
        short_stage(led, clock, "scale", "all-nodes", args, rng)
        soak(led, clock, args, rng)
        led.set_run_status(RUN, "passed")
        led.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        led.close()


def timed(command: list[str]) -> tuple[float, float, float, int, str]:
    """(wall s, CPU s, peak RSS MiB, exit code, stderr tail) of one child (its stdout discarded). The CPU time (user
    + system) varies less than the wall time on a shared machine."""
    with tempfile.TemporaryFile() as errors:
        began = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - began
        child.returncode = os.waitstatus_to_exitcode(status)
        errors.seek(0)
        tail = errors.read().decode(errors="replace")[-600:]
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, child.returncode, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=400_000, help="soak iterations recorded (all attempts)")
    parser.add_argument("--layers", type=int, default=45, help="MoE layers (moe_load/<l>, router_bias/<l>)")
    parser.add_argument("--events", type=int, default=10_000, help="monitor events over the soak")
    parser.add_argument("--restarts", type=int, default=100, help="soak restarts (attempts - 1)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks reporting rank_step_time_s")
    parser.add_argument("--dir", type=Path, help="run directory to build into and keep (reused if it has a ledger)")
    parser.add_argument("--only", choices=("terminal", "html", "none"), help="time one of the two only (none: "
                        "build the ledger only)")
    args = parser.parse_args(argv)
    scratch = None
    if args.dir is None:
        scratch = Path(tempfile.mkdtemp(prefix="report-scale-"))
        args.dir = scratch / RUN
    try:
        if not (args.dir / "ledger.sqlite").exists():
            began = time.perf_counter()
            build(args.dir, args)
            print(f"built {args.dir}/ledger.sqlite in {time.perf_counter() - began:.0f} s", flush=True)
        led = Ledger(args.dir / "ledger.sqlite", create=False)
        rows = led.db.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]
        events = led.db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        led.close()
        size = (args.dir / "ledger.sqlite").stat().st_size / 2**20
        print(f"ledger: {rows:,} metric rows, {events:,} events, {size:,.0f} MiB", flush=True)
        cli = [sys.executable, "-m", "stepdeploy", "report", str(args.dir)]
        html = args.dir / "report.html"
        for name, command in (("terminal", cli), ("html", [*cli, "--html", str(html)])):
            if args.only in (None, name):
                load = os.getloadavg()[0]
                wall, cpu, rss, code, err = timed(command)
                print(f"report {name:8s}: {wall:7.2f} s  CPU {cpu:7.2f} s  peak RSS {rss:8.1f} MiB  exit {code}  "
                      f"(load average {load:.1f} before)", flush=True)
                if code != 0:
                    print(err, file=sys.stderr)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
