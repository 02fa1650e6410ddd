"""Issue 21 on CPU: what a process's first checkpoint save blocks the step loop for, against its later saves, for
both engines, from phases.jsonl's `save` lines (blocking_s), in the same run.

- megatron: tests/unit/workload/megatron_cpu_first_save.py (megatron-core's real DDP, distributed optimizer and
  asynchronous dist-checkpointing on gloo, world 1, the tiny dense model): the Saver as shipped (its set-up done in
  the background from its start) and with --no-setup (as before the fix: the first save does it);
- torch: train.py --engine torch, world 1, the tiny dense model (its saves have no such set-up: one mode).

Each run is a fresh process. Prints one line per run and a summary table (markdown).

    python bench/ckpt_first_save.py [--runs 2] [--saves 4] [--steps 6]
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MEGATRON_SCRIPT = ROOT / "tests" / "unit" / "workload" / "megatron_cpu_first_save.py"
TRAIN = ROOT / "stepdeploy" / "workload" / "train.py"


def megatron_run(workdir: Path, saves: int, steps: int, setup: bool) -> dict[str, Any]:
    command = [sys.executable, str(MEGATRON_SCRIPT), str(workdir), "--saves", str(saves), "--steps", str(steps)]
    proc = subprocess.run(command + ([] if setup else ["--no-setup"]), capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"error: {MEGATRON_SCRIPT.name} exited {proc.returncode}: {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"blocking": [s["blocking_s"] for s in result["saves"]],
            "setup_wait": result["saves"][0]["setup_wait_s"] if setup else None,
            "setup_s": sum(p["seconds"] for p in result["setup"])}


def torch_run(workdir: Path, saves: int, steps: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import Layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    opts = RenderOptions(run_id="bench", iterations=saves * steps, seq_length=32, global_batch_size=4, lr=1e-2,
                         save_interval=steps, pg_timeout_s=60)
    cfg = workload_config(load_model("tiny-dense"), Layout(mbs=2), opts, engine="torch", world=1, peak_tflops=None)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "workload.json").write_text(json.dumps(cfg))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(TRAIN), "--config", str(workdir / "workload.json"), "--out-dir",
                           str(workdir / "out")], env=env, capture_output=True, text=True, check=False, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"error: train.py exited {proc.returncode}: {proc.stdout[-2000:]}")
    phases = [json.loads(line) for line in (workdir / "out" / "phases.jsonl").read_text().splitlines()]
    return {"blocking": [p["blocking_s"] for p in phases if p["phase"] == "save"], "setup_wait": None, "setup_s": None}


def summary(name: str, runs: list[dict[str, Any]]) -> str:
    first = [r["blocking"][0] for r in runs]
    later = [b for r in runs for b in r["blocking"][1:]]
    later_median = statistics.median(later)
    waits = [r["setup_wait"] for r in runs if r["setup_wait"] is not None]
    setups = [r["setup_s"] for r in runs if r["setup_s"]]
    return (f"| {name} | {len(runs)} | {', '.join(f'{x:.2f}' for x in first)} s | {later_median:.2f} s "
            f"({min(later):.2f}-{max(later):.2f}) | {statistics.median(first) / later_median:.1f}x | "
            f"{', '.join(f'{x:.2f}' for x in waits) + ' s' if waits else '-'} | "
            f"{', '.join(f'{x:.1f}' for x in setups) + ' s' if setups else '-'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs (processes) per mode")
    parser.add_argument("--saves", type=int, default=4, help="saves per run")
    parser.add_argument("--steps", type=int, default=6, help="steps before each save")
    args = parser.parse_args()
    modes = {"megatron, before (--no-setup)": lambda w: megatron_run(w, args.saves, args.steps, setup=False),
             "megatron, after (set-up in the background)": lambda w: megatron_run(w, args.saves, args.steps, True),
             "torch": lambda w: torch_run(w, args.saves, args.steps)}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    with tempfile.TemporaryDirectory(prefix="ckpt-first-save-") as tmp:
        for run in range(args.runs):  # modes interleaved: a change in the machine's load hits each alike
            for index, (name, measure) in enumerate(modes.items()):
                result = measure(Path(tmp) / f"{index}-{run}")
                results[name].append(result)
                print(f"{name}, run {run + 1}: blocking {result['blocking']} s, first save's wait for the set-up "
                      f"{result['setup_wait']}, set-up {result['setup_s']} s", flush=True)
    print("\n| engine, Saver | runs | save 1 blocked | saves 2..N blocked: median (range) | save 1 / median | "
          "save 1's wait for the set-up | set-up (background) |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        print(summary(name, runs))


if __name__ == "__main__":
    main()
