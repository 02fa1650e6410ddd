"""What `rollout run --dry-run` lists is what the stages run: every registered stage is driven through
stepdeploy.testing's scripted executor, and the gates it records in the ledger are exactly those its plan names
(per scale rung; the soak's gates when it ran its duration, and only its failure gates besides when it did not).
A gate added to a stage's run path and not to its plan fails here (the attempt service refuses to record it)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from stepdeploy.cli.app import main
from stepdeploy.inventory import load_cluster
from stepdeploy.ledger import Ledger
from stepdeploy.rollout import gates, stages
from stepdeploy.rollout.config import RolloutConfig, StageFailed
from stepdeploy.rollout.runner import Rollout
from stepdeploy.rollout.service import AttemptService, UndeclaredGate
from stepdeploy.testing import FakeClock, FakeNodes

INVENTORY = ("[sim]\nnode1 ansible_host=10.9.0.11\nnode2 ansible_host=10.9.0.12\n"
             "[sim:vars]\nstepdeploy_gpus_per_node=0\nstepdeploy_profile=sim-cpu\n")
BASE = RolloutConfig(inventory="", model="tiny-dense", stages=stages.STAGES, warmup_iterations=10,
                     scale_iterations=30, soak_duration_s=60.0, checkpoint_interval=5, poll_interval_s=1.0,
                     monitor_interval_s=5.0, heartbeat_timeout_s=30.0, node_wait_s=60.0)


def _run(tmp_path: Path, kills: tuple[tuple[int, float], ...] = (), **config: Any
         ) -> tuple[RolloutConfig, Ledger, FakeNodes, str | None]:
    """Drive the rollout to its end on scripted nodes (`kills`: rank 1 killed (start, seconds into it));
    the StageFailed's message when it failed."""
    (tmp_path / "inv.ini").write_text(INVENTORY)
    clock = FakeClock()
    cfg = replace(BASE, inventory=str(tmp_path / "inv.ini"), **config).checked()
    (tmp_path / "r").mkdir()
    ledger = Ledger(tmp_path / "r" / "ledger.sqlite", clock=clock.time)
    ledger.create_run("r", cfg.to_json(), list(cfg.stages))
    nodes = FakeNodes(clock)
    for start, after_s in kills:
        nodes.at(start=start, after_s=after_s, kill=1)
    try:
        Rollout(tmp_path / "r", ledger, "r", cfg, cluster=load_cluster(cfg.inventory), clock=clock.clock,
                executors=nodes.executor).run()
    except StageFailed as exc:
        return cfg, ledger, nodes, exc.message
    return cfg, ledger, nodes, None


def _recorded(ledger: Ledger) -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for v in ledger.verdicts("r"):
        found[(v["stage"], v["rung"])].append(v["gate"])
    return dict(found)


def _planned(config: RolloutConfig) -> dict[str, Any]:
    cluster = load_cluster(config.inventory)
    return {name: stages.load(name).plan(config, cluster) for name in config.stages}


@pytest.mark.parametrize(("model", "proxy", "max_step_time"), [
    ("tiny-dense", None, None),
    ("tiny-dense", None, 5.0),  # every scale rung gets the step-time ceiling
    ("tiny-moe", "tiny-dense", 5.0),  # the target after another model's proxy: MFU against the plan; expert gates
])
def test_every_stage_records_exactly_the_gates_its_plan_lists(tmp_path: Path, model: str, proxy: str | None,
                                                              max_step_time: float | None) -> None:
    config, ledger, _nodes, failed = _run(tmp_path, model=model, proxy_model=proxy,
                                          thresholds=gates.Thresholds(max_step_time_s=max_step_time))
    assert failed is None and ledger.run("r")["status"] == "passed", failed
    plan, recorded = _planned(config), _recorded(ledger)
    assert recorded.pop(("warmup", "target")) == plan["warmup"]["gates"]
    ran = [r for r in plan["scale"] if r["skip_reason"] is None]
    assert len(ran) >= 2
    for rung in ran:
        assert recorded.pop(("scale", rung["rung"])) == rung["gates"], rung["rung"]
    assert sorted(recorded.pop(("soak", "target"))) == sorted(plan["soak"]["gates"])
    assert recorded == {}  # no stage, rung or skipped rung recorded a gate its plan does not list
    names = {g for rung in ran for g in rung["gates"]}
    assert ("step_time" in names) == (max_step_time is not None)
    assert ("mfu_vs_plan" in names) == (proxy is not None)
    assert {"expert_load", "tokens_dropped"} <= set(plan["soak"]["gates"]) or model == "tiny-dense"


def test_a_soak_that_runs_out_of_restarts_records_only_a_gate_its_plan_lists(tmp_path: Path) -> None:
    config, ledger, _nodes, failed = _run(tmp_path, ((1, 20.0), (2, 30.0)), stages=("soak",), soak_max_restarts=1)
    assert failed and "unrecovered failure" in failed, failed
    (verdict,) = ledger.verdicts("r")
    assert verdict["gate"] in _planned(config)["soak"]["gates_on_failure"] and not verdict["passed"]


def test_a_gate_the_plan_does_not_list_is_refused_before_it_is_written(tmp_path: Path) -> None:
    (tmp_path / "inv.ini").write_text(INVENTORY)
    config = replace(BASE, inventory=str(tmp_path / "inv.ini"))
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.create_run("r", config.to_json(), list(config.stages))
    service = AttemptService(tmp_path, ledger, "r", config, load_cluster(config.inventory))
    extra = gates.GateVerdict("throughput_floor", True, 1.0, 1.0, "a gate added to the run path only")
    with pytest.raises(UndeclaredGate, match="throughput_floor not in the stage's plan"):
        service.judge("warmup", "target", [extra], stages.load("warmup").plan(config, service.cluster)["gates"])
    assert ledger.verdicts("r") == []


def test_the_dry_run_prints_the_registered_stages_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "inv.ini").write_text(INVENTORY)
    with pytest.raises(SystemExit) as exit_info:
        main(["rollout", "run", "-i", str(tmp_path / "inv.ini"), "-m", "tiny-moe", "--max-step-time", "5",
              "--checkpoint-interval", "auto", "--run-dir", str(tmp_path / "r"), "--dry-run"])
    printed = json.loads(capsys.readouterr().out)
    assert not exit_info.value.code and printed["stages"] == list(stages.STAGES)
    config = RolloutConfig(inventory=str((tmp_path / "inv.ini").resolve()), model="tiny-moe", stages=stages.STAGES,
                           checkpoint_interval="auto", thresholds=gates.Thresholds(max_step_time_s=5.0))
    for name, plan in _planned(config).items():
        assert printed[name] == json.loads(json.dumps(plan)), name
    assert printed["soak"]["gates_on_failure"] == ["no_unrecovered_failure", "progress"]
    assert all("step_time" in r["gates"] for r in printed["scale"])
    assert not (tmp_path / "r").exists()
