"""A rollout ledger written through the real Ledger API, with a clock the test drives.

Run `r1` (4 ranks on 2 nodes unless a rung says otherwise):
  warmup/target      1 attempt, passed; 10 steps; rank 2 is 20 % slower; no memory figures (CPU)
  scale/proxy-1gpu   1 attempt, passed; 20 steps; 1 rank (no skew)
  scale/one-node     1 attempt, passed; 20 steps; 2 equal ranks
  scale/all-nodes    attempt 1: gate scaling_efficiency FAILED (0.41 < 0.7), stage and run failed;
                     resumed: attempt 2 passed (0.85 >= 0.5); rank 1 is 25 % slower in attempt 2
  soak/target        attempt 1 dies at step 30 (a fault event with a hostile message), attempt 2 restores
                     from step 20 and finishes step 60; memory figures; run passed
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from stepdeploy.ledger import Ledger

T0 = 1_700_000_000.0
HOSTILE = "<script>alert(1)</script> rank 3 died [bold red]SIGKILL[/] $x$"


@dataclass
class Clock:
    t: float = T0

    def __call__(self) -> float:
        return self.t


@dataclass
class Steps:
    """What one attempt records per iteration."""

    first: int
    last: int
    loss: Callable[[int], float]
    tokens: float
    rank_times: tuple[float, ...]
    mem_peak: float | None = None
    step_s: float = 2.0


def run_attempt(led: Ledger, clock: Clock, stage: str, rung: str, steps: Steps, status: str | None,
                detail: dict | None = None) -> int:
    """Start an attempt, record its steps, and finish it with `status` (None: leave it running)."""
    attempt = led.start_attempt("r1", stage, rung, detail or {"rung": rung, "nodes": 2, "model": "tiny-dense"})
    rows = []
    for it in range(steps.first, steps.last + 1):
        clock.t += steps.step_s
        rows += [(clock.t, 0, it, "loss", steps.loss(it)), (clock.t, 0, it, "tokens_per_s", steps.tokens),
                 (clock.t, 0, it, "step_time_s", max(steps.rank_times))]
        rows += [(clock.t, rank, it, "rank_step_time_s", value) for rank, value in enumerate(steps.rank_times)]
        if steps.mem_peak is not None:
            rows += [(clock.t, 0, it, "mem_allocated_gib", steps.mem_peak - 2.0),
                     (clock.t, 0, it, "mem_reserved_gib", steps.mem_peak + 1.0),
                     (clock.t, 0, it, "mem_peak_gib", steps.mem_peak)]
    led.add_metrics("r1", attempt, rows)
    clock.t += 1
    if status is not None:
        led.finish_attempt(attempt, status)
    return attempt


def _warmup(led: Ledger, clock: Clock) -> None:
    led.add_rungs("r1", "warmup", [("target", {"nodes": 2})])
    led.set_stage("r1", "warmup", "running")
    run_attempt(led, clock, "warmup", "target", Steps(1, 10, lambda i: 6.0 - 0.1 * i, 2000.0,
                                                      (0.5, 0.5, 0.6, 0.5)), "passed")
    led.verdict("r1", "warmup", "target", "all_ranks_finished", True, measured=4, threshold=4, reason="4 of 4 ranks")
    led.verdict("r1", "warmup", "target", "loss_finite", True, measured=5.0, threshold=None, reason="finite")
    led.set_rung("r1", "warmup", "target", "passed")
    led.set_stage("r1", "warmup", "passed")


def _scale(led: Ledger, clock: Clock) -> None:
    led.add_rungs("r1", "scale", [("proxy-1gpu", {"nodes": 1}), ("one-node", {"nodes": 1}),
                                  ("all-nodes", {"nodes": 2})])
    led.set_stage("r1", "scale", "running")
    clock.t += 5
    run_attempt(led, clock, "scale", "proxy-1gpu", Steps(1, 20, lambda i: 7.0 - 0.05 * i, 500.0, (0.3,)), "passed")
    led.set_rung("r1", "scale", "proxy-1gpu", "passed")
    run_attempt(led, clock, "scale", "one-node", Steps(1, 20, lambda i: 7.0 - 0.05 * i, 950.0, (0.4, 0.4)), "passed")
    led.set_rung("r1", "scale", "one-node", "passed")
    run_attempt(led, clock, "scale", "all-nodes", Steps(1, 20, lambda i: 7.0 - 0.04 * i, 800.0,
                                                        (0.4, 0.4, 0.4, 0.8)), "failed")
    led.verdict("r1", "scale", "all-nodes", "scaling_efficiency", False, measured=0.41, threshold=0.7,
                reason="throughput per GPU 0.41 of the previous rung < 0.7")
    led.set_rung("r1", "scale", "all-nodes", "failed", reason="scaling_efficiency 0.41 < 0.7")
    led.set_stage("r1", "scale", "failed", reason="rung all-nodes: scaling_efficiency 0.41 < 0.7")
    led.set_run_status("r1", "failed")
    clock.t += 100  # the operator fixes the threshold, then: stepdeploy rollout resume
    led.set_run_status("r1", "running")
    led.set_stage("r1", "scale", "running")
    run_attempt(led, clock, "scale", "all-nodes", Steps(1, 20, lambda i: 7.0 - 0.04 * i, 1500.0,
                                                        (0.4, 0.5, 0.4, 0.4)), "passed")
    led.verdict("r1", "scale", "all-nodes", "scaling_efficiency", True, measured=0.85, threshold=0.5,
                reason="throughput per GPU 0.85 of the previous rung >= 0.5")
    led.set_rung("r1", "scale", "all-nodes", "passed")
    led.set_stage("r1", "scale", "passed")


def _soak(led: Ledger, clock: Clock) -> None:
    led.add_rungs("r1", "soak", [("target", {"nodes": 2, "duration_s": 120})])
    led.set_stage("r1", "soak", "running")
    soak = Steps(1, 30, lambda i: 5.0 - 0.03 * i, 2100.0, (0.5, 0.5, 0.5, 0.5), mem_peak=10.5)
    attempt = run_attempt(led, clock, "soak", "target", soak, None)
    led.event("r1", "fault", HOSTILE, stage="soak", rung="target", data={"attempt": attempt})
    led.finish_attempt(attempt, "failed", {"exit": {"node2": -9}})
    clock.t += 10
    run_attempt(led, clock, "soak", "target", Steps(21, 60, lambda i: 5.0 - 0.03 * i, 2200.0, (0.5, 0.5, 0.5, 0.5),
                                                    mem_peak=11.25), "passed",
                detail={"rung": "target", "nodes": 2, "model": "tiny-dense", "restored_from": "iter_0000020"})
    led.verdict("r1", "soak", "target", "no_unrecovered_failure", True, measured={"failures": 1, "recovered": 1},
                threshold={"unrecovered": 0}, reason="1 failure, recovered from iter 20")
    led.set_rung("r1", "soak", "target", "passed")
    led.set_stage("r1", "soak", "passed")
    led.set_run_status("r1", "passed")


def build_full_run(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    led = Ledger(run_dir / "ledger.sqlite", clock=clock)
    led.create_run("r1", {"model": "tiny-dense", "inventory": "sim", "stages": ["warmup", "scale", "soak"]},
                   ["warmup", "scale", "soak"])
    led.set_run_status("r1", "running")
    _warmup(led, clock)
    _scale(led, clock)
    _soak(led, clock)
    led.close()
    return run_dir


def build_early_failure(run_dir: Path) -> Path:
    """Warmup's only attempt fails before any metric; scale and soak never start."""
    run_dir.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    led = Ledger(run_dir / "ledger.sqlite", clock=clock)
    led.create_run("r1", {"model": "tiny-dense"}, ["warmup", "scale", "soak"])
    led.set_stage("r1", "warmup", "running")
    attempt = led.start_attempt("r1", "warmup", "target", {"rung": "target", "nodes": 2})
    clock.t += 12
    led.finish_attempt(attempt, "failed", {"exit": {"node1": 1}})
    led.set_stage("r1", "warmup", "failed", reason="rank 0 exited 1: ImportError: torch")
    led.set_run_status("r1", "failed")
    led.close()
    return run_dir


@pytest.fixture
def full_run(tmp_path: Path) -> Path:
    return build_full_run(tmp_path / "r1")


@pytest.fixture
def early_failure(tmp_path: Path) -> Path:
    return build_early_failure(tmp_path / "r1")
