"""What starting a node's ranks costs with each launcher launch.sh can run (issue 37: every start and restart of a
soak pays it): torchrun (`python -m torch.distributed.run`, static rendezvous, as launch.sh.j2 renders it for a c10d
rendezvous or torchrun's own restarts) against stepdeploy's workload/launch_ranks.py (the default).

    python bench/launch_cost.py [--repeats 7] [--nproc 2] [--json]

Per launch, alternating the launchers: `start` (the launcher's exec to the first line of the last worker to begin),
and `exit after a death` (a worker SIGKILLs itself once every worker has begun; its death to the launcher's exit:
torchrun polls its workers every --monitor-interval, launch_ranks waits on them). Workers are `python -u` scripts
that import nothing, so the figures are the launchers' own. Medians and their ratio; absolute times depend on the
machine (the interpreter's and torch's imports): compare the two within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH_RANKS = Path(__file__).resolve().parent.parent / "stepdeploy" / "workload" / "launch_ranks.py"
WORKER = """
import os, signal, sys, time
began = time.time()
out, nproc = sys.argv[1], int(sys.argv[2])
with open(os.path.join(out, "began" + os.environ["LOCAL_RANK"]), "w") as handle:
    handle.write(repr(began))
if os.environ["LOCAL_RANK"] == "0":
    while len([n for n in os.listdir(out) if n.startswith("began")]) < nproc:
        time.sleep(0.005)
    with open(os.path.join(out, "death"), "w") as handle:
        handle.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def command(launcher: str, nproc: int, port: int) -> list[str]:
    if launcher == "launch_ranks":
        return [sys.executable, "-I", str(LAUNCH_RANKS), "--nnodes=1", f"--nproc-per-node={nproc}", "--node-rank=0",
                "--master-addr=127.0.0.1", f"--master-port={port}", "--"]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
            "--node-rank=0", "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
            "--monitor-interval=1"]


def one(launcher: str, nproc: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="launch-cost-") as tmp:
        out = Path(tmp)
        script = out / "worker.py"
        script.write_text(WORKER)
        began = time.time()
        proc = subprocess.Popen([*command(launcher, nproc, _port()), str(script), str(out), str(nproc)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc.wait(timeout=120)
        ended = time.time()
        starts = [float((out / f"began{rank}").read_text()) for rank in range(nproc)]
        death = float((out / "death").read_text())
    return {"start_s": max(starts) - began, "exit_after_death_s": ended - death}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    launchers = ("torchrun", "launch_ranks")
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in launchers}
    for _ in range(args.repeats):
        for name in launchers:
            samples[name].append(one(name, args.nproc))
    result = {name: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
              for name, runs in samples.items()}
    result["ratio_start"] = result["launch_ranks"]["start_s"] / result["torchrun"]["start_s"]
    result["saved_start_s"] = result["torchrun"]["start_s"] - result["launch_ranks"]["start_s"]
    if args.json:
        print(json.dumps({"repeats": args.repeats, "nproc": args.nproc, "cpus": os.cpu_count(), **result}, indent=2))
        return 0
    print(f"{args.repeats} launches each, {args.nproc} worker(s), {os.cpu_count()} CPU(s); medians")
    print(f"{'launcher':<14} {'start':>8} {'exit after a death':>20}")
    for name in launchers:
        print(f"{name:<14} {result[name]['start_s']:>7.3f}s {result[name]['exit_after_death_s']:>19.3f}s")
    print(f"launch_ranks / torchrun start: {result['ratio_start']:.2f}x ({result['saved_start_s']:.3f} s saved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
