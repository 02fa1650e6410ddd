"""`stepdeploy demo`: the whole path on the embedded simulated cluster, as the commands a user would type.

sim up -> inventory show -> provision -> preflight -> plan -> (render -> run launch -> run logs -> run stop:
a run by hand) -> data prepare (this checkout's docs) -> rollout on that data (warmup, scale, a short soak) ->
report -> sim down. Each step runs the real
CLI in a subprocess and prints the command first, so the demo is also the tutorial.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import typer

from stepdeploy import safeio
from stepdeploy.cli.output import err, info
from stepdeploy.cli.rollout import parse_duration
from stepdeploy.errors import StepdeployError
from stepdeploy.sim.cluster import MAX_NODES, SimConfig

# The simulated nodes share this machine's cores: two ranks cannot scale like two GPUs, so the demo's
# scaling gate is set for that (a real cluster keeps the default 0.7); small sequences keep it quick.
SEED_INVENTORY = Path(__file__).resolve().parents[2] / "inventory" / "dgx.ini"
# the rollout trains on real text: this checkout's own docs, tokenized byte-level (nothing downloaded)
DEMO_TEXT = [Path(__file__).resolve().parents[2] / "README.md", Path(__file__).resolve().parents[2] / "docs"]
WAIT: list[str] = []  # a pause between launching the hand-rendered run and reading its logs
LAUNCH_SECONDS = 20
DEMO_ROLLOUT = ["--seq", "64", "--gbs", "4", "--warmup-iterations", "5", "--scale-iterations", "10",
                "--checkpoint-interval", "5", "--min-scaling-efficiency", "0.1", "--pg-timeout", "30"]


def demo(
    nodes: int = typer.Option(2, "--nodes", "-N", min=1, max=MAX_NODES, help="Nodes in the simulated cluster."),
    soak: str = typer.Option("30s", "--soak-duration", help="Length of the demo's soak stage."),
    runs: Path = typer.Option(Path("runs"), "--runs", help="Where the rollout's run directory goes."),
    keep: bool = typer.Option(False, "--keep", help="Leave the cluster running afterwards."),
) -> None:
    """Run the whole pipeline on the embedded simulated cluster (needs root; the first run builds the node
    image, a few minutes): sim up, inventory, provision, preflight, plan, render + run launch/logs/stop,
    data prepare, rollout on that data, report, sim down."""
    parse_duration(soak)  # every option is checked before the first step changes anything
    safeio.check_output_dir(runs, "demo's run directories")
    inv = str(SimConfig().inventory)
    stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
    run_dir, launch_dir = runs / f"demo-{stamp}", runs / f"demo-launch-{stamp}"
    corpus = runs / f"demo-data-{stamp}" / "corpus"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        ["sim", "up", "--nodes", str(nodes)],
        ["inventory", "show", inv],
        ["provision", inv],
        ["preflight", inv, "--min-free-gib", "1"],
        ["plan", "--model", "step-3.5-flash", "-i", str(SEED_INVENTORY), "--top", "3"],
        # render -> launch -> logs -> stop, by hand (the CPU nodes run the torch engine, data parallel: there is
        # no GPU memory to plan), a run long enough that only the stop ends it
        ["render", "-i", inv, "-m", "tiny-dense", "--out", str(launch_dir), "--seq", "64", "--gbs", "4",
         "--iterations", "100000", "--pg-timeout", "30"],
        ["run", "launch", str(launch_dir)],
        WAIT,
        ["run", "logs", str(launch_dir), "--tail", "3"],
        ["run", "stop", str(launch_dir)],
        ["data", "prepare", *[str(p) for p in DEMO_TEXT], "--out", str(corpus)],
        ["rollout", "run", "-i", inv, "--model", "tiny-moe", "--soak-duration", soak, *DEMO_ROLLOUT,
         "--data", str(corpus), "--run-dir", str(run_dir)],
        ["report", str(run_dir), "--html", str(run_dir / "report.html")],
    ]
    started = time.monotonic()
    number = 0
    try:
        for args in steps:
            if args is WAIT:
                info(f"letting the launched run train for {LAUNCH_SECONDS} s")
                time.sleep(LAUNCH_SECONDS)
                continue
            number += 1
            _step(number, args)
    finally:
        if not keep:
            _step(number + 1, ["sim", "down"])
    info(f"demo finished in {time.monotonic() - started:.0f} s; report: {run_dir / 'report.html'}")


def _step(number: int, args: list[str]) -> None:
    err.rule(f"{number}. stepdeploy {' '.join(args)}", align="left")
    code = subprocess.call([sys.executable, "-m", "stepdeploy", *args])
    # The plan step judges the seed's 16-GPU DGX pair, where the target may not fit: its exit 1 is a verdict.
    if code != 0 and not (args[0] == "plan" and code == 1):
        raise StepdeployError(f"demo step {number} (stepdeploy {args[0]}) exited {code}")
