"""`stepdeploy demo`: the whole path on the embedded simulated cluster, as the commands a user would type.

sim up -> inventory show -> provision -> preflight -> plan -> (render -> run launch -> run logs -> run stop:
a run by hand) -> data prepare (stepdeploy's docs but its measurement logs, a BPE tokenizer trained on them) ->
rollout on that data (warmup, scale, a soak of a fixed number of iterations) -> report -> sim down, then what it
proved. Each step runs the real CLI in a subprocess and prints the command first, so the demo is also the
tutorial.

Its outcome does not depend on the machine's speed: every stage trains a fixed number of iterations (the soak too:
--soak-iterations) on the same shuffled data, so a fast and a slow machine train the same model through the same
learning-rate schedule (tests/unit/test_demo_training.py trains it over several seeds and judges the soak's gates).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import typer

from stepdeploy import safeio
from stepdeploy.cli.output import err, info, out
from stepdeploy.errors import StepdeployError
from stepdeploy.seed import seed_path
from stepdeploy.sim.cluster import MAX_NODES, SimConfig

# The plan step's cluster: two 8xH100 HGX servers with a stack the megatron engine runs (hopper-cu128). The seed's
# DGX pair (inventory/dgx.ini) has the same GPUs, but its seed-2024 stack (megatron-core 0.8.0) is refused (exit 2).
PLAN_INVENTORY = "inventory/examples/hgx-h100-pair.ini"
# the rollout trains on real text: stepdeploy's own docs (shipped with the package), tokenized by a byte-level BPE
# trained on them (nothing downloaded). Not the measurement logs: their tables of figures grow every session, and
# with them in, a batch of figures gave the demo's soak a loss spike on its own seed (2026-12-06: 7.97 against a
# running median of 6.33 at iteration 54; tests/unit/workload/test_demo_training.py)
DEMO_TEXT = seed_path("docs")
DEMO_SKIPPED = ("benchmarks.md", "benchmarks-log.md")
DEMO_VOCAB = 4096  # the BPE's tokens: within tiny-moe's vocabulary of 8,192
WAIT: list[str] = []  # a pause between launching the hand-rendered run and reading its logs
LAUNCH_SECONDS = 10  # the launched run's start-up is ~6 s on 2 cores: a few steps to show
SOAK_ITERATIONS = 80
# The simulated nodes share this machine's cores: two ranks cannot scale like two GPUs, so the demo's scaling gate
# is set for that (a real cluster keeps the default 0.7); small sequences keep it quick. A batch of 8 x 64 tokens, not
# 4 x 64: with 256 tokens a step one batch of unusual text stood 6 noise units above the running median on 1 of 7
# seeds (the loss_spikes gate judges the run's noise; docs/benchmarks.md, "The demo's soak over seeds").
DEMO_ROLLOUT = ["--seq", "64", "--gbs", "8", "--warmup-iterations", "5", "--scale-iterations", "10",
                "--checkpoint-interval", "20", "--min-scaling-efficiency", "0.1", "--pg-timeout", "30"]
NEXT = (f"stepdeploy provision {PLAN_INVENTORY} && stepdeploy preflight {PLAN_INVENTORY} && stepdeploy rollout "
        f"run -i {PLAN_INVENTORY} -m step-3.5-flash-slice-ep2 --stages warmup,scale,soak --soak-duration 2h")


def demo_texts() -> list[Path]:
    """What the demo's `data prepare` reads: the docs' Markdown files but the measurement logs, in name order."""
    return sorted(path for path in DEMO_TEXT.glob("*.md") if path.name not in DEMO_SKIPPED)


def demo(
    nodes: int = typer.Option(2, "--nodes", "-N", min=1, max=MAX_NODES, help="Nodes in the simulated cluster."),
    soak_iterations: int = typer.Option(SOAK_ITERATIONS, "--soak-iterations", min=20, max=100_000,
                                        help="Iterations the demo's soak trains (the same on any machine)."),
    runs: Path = typer.Option(Path("runs"), "--runs", help="Where the rollout's run directory goes."),
    keep: bool = typer.Option(False, "--keep", help="Leave the cluster running afterwards."),
) -> None:
    """Run the whole pipeline on the embedded simulated cluster (needs root; the first run builds the node
    image, a few minutes): sim up, inventory, provision, preflight, plan, render + run launch/logs/stop,
    data prepare, rollout on that data, report, sim down; then a summary of what it proved."""
    safeio.check_output_dir(runs, "demo's run directories")
    inv = str(SimConfig().inventory)
    stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
    run_dir, launch_dir = runs / f"demo-{stamp}", runs / f"demo-launch-{stamp}"
    corpus = runs / f"demo-data-{stamp}" / "corpus"
    steps = [
        ["sim", "up", "--nodes", str(nodes)],
        ["inventory", "show", inv],
        ["provision", inv],
        ["preflight", inv, "--min-free-gib", "1"],
        ["plan", "--model", "step-3.5-flash", "-i", str(seed_path(PLAN_INVENTORY)), "--top", "3"],
        # render -> launch -> logs -> stop, by hand (the CPU nodes run the torch engine, data parallel: there is
        # no GPU memory to plan), a run long enough that only the stop ends it
        ["render", "-i", inv, "-m", "tiny-dense", "--out", str(launch_dir), "--seq", "64", "--gbs", "4",
         "--iterations", "100000", "--pg-timeout", "30"],
        ["run", "launch", str(launch_dir)],
        WAIT,
        ["run", "logs", str(launch_dir), "--tail", "3"],
        ["run", "stop", str(launch_dir)],
        ["data", "prepare", *map(str, demo_texts()), "--train-tokenizer", str(DEMO_VOCAB), "--out", str(corpus)],
        ["rollout", "run", "-i", inv, "--model", "tiny-moe", "--soak-iterations", str(soak_iterations),
         *DEMO_ROLLOUT, "--data", str(corpus), "--run-dir", str(run_dir)],
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
    took = time.monotonic() - started
    err.rule("what the demo proved", align="left")
    out.print("\n".join(proved(run_dir, nodes, took)), markup=False, highlight=False)


def proved(run_dir: Path, nodes: int, took_s: float) -> list[str]:
    """The demo's closing summary, from the rollout's ledger: stages, gates, goodput, the report, the next command."""
    from stepdeploy.cli.report import load_run_data
    from stepdeploy.report.summary import summarise

    summary = summarise(load_run_data(run_dir))
    stages = ", ".join(f"{s.name} {s.status}" for s in summary.stages)
    passed = [g for g in summary.gates if g.passed]
    soak_gates = sorted({g.gate for g in summary.gates if g.stage == "soak"})
    ratio = (summary.goodput or {}).get("ratio")
    goodput = f"{ratio:.1%} of the soak's wall time trained" if isinstance(ratio, float) else "not recorded"
    return [
        f"cluster   {nodes} simulated node(s): provisioned with Ansible, preflight passed, torn down",
        f"rollout   {summary.status}: {stages}",
        f"gates     {len(passed)} of {len(summary.gates)} passed; the soak's: {', '.join(soak_gates)}",
        f"goodput   {goodput}",
        f"report    {run_dir / 'report.html'}  (stepdeploy report {run_dir})",
        f"took      {took_s / 60:.1f} min",
        f"next, on real GPU nodes (put their addresses in {PLAN_INVENTORY} first): {NEXT}",
    ]


def _step(number: int, args: list[str]) -> None:
    err.rule(f"{number}. stepdeploy {' '.join(args)}", align="left")
    started = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "stepdeploy", *args])
    info(f"step {number} took {time.monotonic() - started:.1f} s")
    # The plan step judges a 16-GPU HGX pair, where the target does not fit: its exit 1 is a verdict.
    if code != 0 and not (args[0] == "plan" and code == 1):
        raise StepdeployError(f"demo step {number} (stepdeploy {args[0]}) exited {code}")
