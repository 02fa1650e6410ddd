"""Rollout's pure parts: the scaling ladder a cluster gets, and each gate's verdict on given metrics."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from stepdeploy.errors import BadInput
from stepdeploy.inventory import load_cluster
from stepdeploy.rollout import gates
from stepdeploy.rollout.ladder import scale_ladder, sub_cluster, target_rung
from stepdeploy.rollout.stages import parse_stages

ROOT = Path(__file__).resolve().parents[2]


def test_dgx_pair_gets_four_rungs_from_one_gpu_to_the_target() -> None:
    cluster = load_cluster(ROOT / "inventory/dgx.ini")
    rungs = scale_ladder(cluster, "step-3.5-flash")
    assert [(r.name, r.model, r.nodes, r.nproc_per_node, r.skip_reason) for r in rungs] == [
        ("proxy-1-gpu", "proxy-0.7b-moe", 1, 1, None),  # an MoE target: expert dispatch before the target
        ("proxy-1-node", "proxy-0.7b-moe", 1, 8, None),
        ("proxy-all-nodes", "proxy-0.7b-moe", 2, 8, None),
        ("target-all-nodes", "step-3.5-flash", 2, 8, None),
    ]
    assert {r.model for r in scale_ladder(cluster, "gpt3-175b-seed")[:3]} == {"proxy-0.7b-dense"}
    assert {r.model for r in scale_ladder(cluster, "step-3.5-flash", "proxy-0.7b-dense")[:3]} == {"proxy-0.7b-dense"}
    assert target_rung(cluster, "step-3.5-flash").world == 16
    assert [n.name for n in sub_cluster(cluster, 1).nodes] == ["dgx-01"]


def test_cpu_nodes_skip_the_rung_that_would_repeat_the_previous_one(tmp_path: Path) -> None:
    inv = tmp_path / "inv.ini"
    inv.write_text("[sim]\nnode1 ansible_host=10.9.0.11\nnode2 ansible_host=10.9.0.12\n"
                   "[sim:vars]\nstepdeploy_gpus_per_node=0\nstepdeploy_profile=sim-cpu\n")
    rungs = scale_ladder(load_cluster(inv), "tiny-moe")
    assert [r.model for r in rungs] == ["tiny-moe"] * 4
    # the target is its own proxy here: its rung would repeat proxy-all-nodes
    assert rungs[3].skip_reason == "same as rung proxy-all-nodes on this cluster (2 rank(s))"
    assert rungs[1].skip_reason == "same as rung proxy-1-gpu on this cluster (1 rank(s))"
    assert [r.world for r in rungs if not r.skip_reason] == [1, 2]
    assert [r.model for r in scale_ladder(load_cluster(inv), "tiny-dense")] == ["tiny-dense"] * 4


def test_parse_stages_orders_and_refuses_unknown() -> None:
    assert parse_stages("soak,warmup") == ("warmup", "soak")
    with pytest.raises(BadInput, match="unknown stage burnin"):
        parse_stages("warmup,burnin")


def _metrics(losses: list[float], tok: float = 1000.0) -> list[dict]:
    return [{"iteration": i + 1, "loss": loss, "step_time_s": 2.0 if i == 0 else 0.5, "tokens_per_s": tok}
            for i, loss in enumerate(losses)]


def test_loss_gates() -> None:
    t = gates.Thresholds()
    assert gates.losses_finite(_metrics([3.0, 2.0])).passed
    nan = gates.losses_finite(_metrics([3.0, math.nan, 2.0]))
    assert not nan.passed and nan.reason == "non-finite loss at iteration 2"
    falling = gates.loss_falling(_metrics([5, 5, 5, 4, 3, 2]), t)
    assert falling.passed and falling.measured == {"first": 5.0, "last": 3.0}
    assert not gates.loss_falling(_metrics([2, 2, 2, 3, 3, 3]), t).passed
    assert not gates.loss_falling(_metrics([5, 4]), t).passed  # too few iterations to tell


def test_step_times_and_throughput() -> None:
    m = _metrics([5, 4, 3, 2], tok=800.0)
    assert gates.steady_step_time(m) == (2.0, 0.5)
    assert gates.throughput_per_gpu(m, gpus=2) == 400.0


def test_scaling_efficiency_gate() -> None:
    t = gates.Thresholds(min_scaling_efficiency=0.7)
    assert gates.scaling_efficiency(500.0, None, t).passed  # the first rung is the baseline
    ok = gates.scaling_efficiency(750.0, 1000.0, t)
    assert ok.passed and ok.measured == 0.75
    slow = gates.scaling_efficiency(600.0, 1000.0, t)
    assert not slow.passed and "(< 0.7)" in slow.reason


def test_memory_gate() -> None:
    t = gates.Thresholds(memory_tolerance=0.05)
    assert gates.memory_matches_plan(29.1, 28.0, t).passed
    off = gates.memory_matches_plan(35.0, 28.0, t)
    assert not off.passed and "+25.0%" in off.reason
    assert gates.memory_matches_plan(None, 28.0, t).passed  # CPU run: not judged, and says so


def test_completed_gate_names_the_culprit() -> None:
    v = gates.completed(False, ["node node2 rank 1: died without exiting", "node node1 rank 0: exited 3"])
    assert not v.passed and v.reason == "node node2 rank 1: died without exiting"
    assert gates.completed(True, []).passed


def test_live_view_shows_per_rank_step_time_and_gpu_memory(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from stepdeploy.ledger import Ledger
    from stepdeploy.remote.executor import NodeStatus, RankStatus, RunStatus
    from stepdeploy.rollout.attempt import Live
    from stepdeploy.rollout.view import render

    led = Ledger(tmp_path / "ledger.sqlite")
    led.create_run("r", {}, ["warmup"])
    led.set_stage("r", "warmup", "running")
    live = Live(stage="warmup", rung="target", iteration=7, total=10, started=0.0,
                last={"loss": 5.25, "tokens_per_s": 1234.0, "step_time_s": 0.5, "rank_step_time_s": [0.5, 0.625],
                      "mem_allocated_gib": 20.75},
                status=RunStatus((NodeStatus("node1", "running", None, (RankStatus(0, "node1", 10, "running",
                                                                                       iteration=7),)),
                                  NodeStatus("node2", "running", None, (RankStatus(1, "node2", 11, "running",
                                                                                       iteration=7),)))))
    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None).print(render(led, "r", live, now=3.0))
    text = buf.getvalue()
    assert "target: iteration 7/10 — loss 5.2500, 1,234 tok/s, step 0.500 s" in text
    assert "0.625 s" in text and "20.8 GiB" in text


class _Polls:
    """An executor stand-in for follow()'s decision order: it returns the given statuses, one per poll."""

    def __init__(self, *statuses: object) -> None:
        self.statuses, self.targets = list(statuses), []

    def poll(self) -> object:
        return self.statuses.pop(0)

    def run_command(self, command: str, targets: object = None) -> list[object]:
        return []


def test_follow_looks_at_a_requested_stop_before_the_monitors_and_the_exit() -> None:
    """Ranks that `rollout stop` killed must end the follow as a stop, not as a crash the soak restarts
    (the race the Slurm executor's stop test met)."""
    from stepdeploy.remote.executor import NodeStatus, RankStatus, RunStatus
    from stepdeploy.rollout.attempt import Live, follow

    killed = RunStatus((NodeStatus("node1", "exited", 137, (RankStatus(0, "node1", 5, "died"),)),))
    seen: list[object] = []

    def check(status: object) -> str:
        seen.append(status)
        return "crash: node1 rank 0"

    status, why = follow(_Polls(killed), Live(), deadline=time.time() + 60, interval=0.01,
                         should_stop=lambda: True, on_tick=lambda _live: None, check=check)
    assert (status, why) == (killed, "stop requested") and seen == []
    status, why = follow(_Polls(killed), Live(), deadline=time.time() + 60, interval=0.01,
                         should_stop=lambda: False, on_tick=lambda _live: None, check=check)
    assert why == "crash: node1 rank 0" and seen == [killed]
    finished = RunStatus((NodeStatus("node1", "exited", 0),))
    assert follow(_Polls(finished), Live(), deadline=time.time() + 60, interval=0.01, should_stop=lambda: False,
                  on_tick=lambda _live: None)[1] == "exited"


def test_a_rung_that_changes_the_model_is_judged_by_mfu_against_its_plan() -> None:
    t = gates.Thresholds(min_mfu_vs_plan=0.7)
    ok = gates.mfu_matches_plan(0.519, 0.513, t)
    assert ok.passed and ok.gate == "mfu_vs_plan" and ok.measured == 1.012
    low = gates.mfu_matches_plan(0.30, 0.513, t)
    assert not low.passed and "(< 0.7)" in low.reason
    assert gates.mfu_matches_plan(None, 0.5, t).passed  # CPU run: not judged, and says so
    metrics = [{"mfu": 0.05}, {"mfu": 0.52}, {"mfu": 0.50}, {"mfu": 0.53}]  # the first step is warm-up
    assert gates.steady_mfu(metrics) == 0.52


def test_scale_gates_compare_rungs_of_the_same_model_only() -> None:
    """An MoE target after a dense proxy on one GPU failed "efficiency 0.55 < 0.7" before: two models' per-GPU
    throughputs say nothing about scaling. Now the target rung is judged by its MFU against its plan."""
    from types import SimpleNamespace

    from stepdeploy.rollout.ladder import Rung
    from stepdeploy.rollout.stages.scale import rung_verdicts

    fake = SimpleNamespace(config=SimpleNamespace(thresholds=gates.Thresholds()))
    metrics = [{"iteration": i + 1, "loss": 5.0 - 0.1 * i, "tokens_per_s": 1000.0, "mfu": 0.5, "mem_peak_gib": 10.0}
               for i in range(8)]
    plan = {"predicted_mfu": 0.5, "predicted_torch_allocated_gib": 10.0}
    target = rung_verdicts(fake.config, Rung("target-all-nodes", "big-moe", 1, 1), metrics, plan, ("proxy", 5000.0))
    assert [v.gate for v in target] == ["loss_falling", "mfu_vs_plan", "memory_vs_plan"]
    assert all(v.passed for v in target)
    proxy = rung_verdicts(fake.config, Rung("proxy-1-node", "proxy", 1, 1), metrics, plan, ("proxy", 5000.0))
    scaling = next(v for v in proxy if v.gate == "scaling_efficiency")
    assert not scaling.passed and scaling.measured == 0.2  # the same model: a real scaling verdict
    first = rung_verdicts(fake.config, Rung("proxy-1-gpu", "proxy", 1, 1), metrics, plan, None)
    assert next(v for v in first if v.gate == "scaling_efficiency").reason == "first rung: the baseline"


def test_the_soak_schedule_is_sized_from_its_expected_iterations() -> None:
    from stepdeploy.rollout.stages.soak import MAX_WARMUP, soak_schedule

    # the dense soak: 150 s at 0.645 s a step
    s = soak_schedule(150.0, 0.645, "measured in the warm-up")
    assert (s.expected, s.warmup, s.decay) == (232, 11, 232)
    assert s.to_json()["warmup_iterations"] == 11
    week = soak_schedule(72 * 3600.0, 0.5, "the planner's prediction")  # a 72-hour soak: warm-up capped
    assert week.warmup == MAX_WARMUP and week.decay == week.expected == 518_400
    tiny = soak_schedule(1.0, 5.0, "assumed")
    assert (tiny.expected, tiny.warmup, tiny.decay) == (2, 1, 2)
    # the start-up the warm-up measured comes off the duration first; at most half of it (a cold start)
    started = soak_schedule(150.0, 0.645, "measured in the warm-up", startup_s=20.0)
    assert (started.expected, started.warmup, started.decay) == (201, 10, 201) and started.to_json()["startup_s"] == 20
    cold = soak_schedule(150.0, 0.645, "measured in the warm-up", startup_s=120.0)
    assert cold.expected == int(75.0 / 0.645) and cold.startup_s == 75.0


def test_a_soak_of_fixed_iterations_has_one_schedule_whatever_the_step_time() -> None:
    """--soak-iterations (the demo's soak): a fast and a slow machine train the same iterations through the same
    learning-rate schedule, where a timed soak's schedule follows the step time."""
    from stepdeploy.rollout.stages.soak import soak_schedule

    steps = (0.01, 0.3, 2.0, 30.0)
    fixed = {(s.expected, s.warmup, s.decay) for s in
             (soak_schedule(30.0, step_s, "measured", startup_s=10.0, iterations=120) for step_s in steps)}
    assert fixed == {(120, 6, 120)}
    assert len({soak_schedule(30.0, step_s, "measured").expected for step_s in steps}) == len(steps)
