"""The stages keep their books through the attempt service: no stage holds the ledger, and what the warm-up
measured reaches the soak as a typed value (stages/measured.py)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import stepdeploy.rollout.stages
from stepdeploy.inventory import load_cluster
from stepdeploy.ledger import Ledger
from stepdeploy.rollout.config import RolloutConfig
from stepdeploy.rollout.service import AttemptService
from stepdeploy.rollout.stages.measured import TargetStep

STAGES_DIR = Path(stepdeploy.rollout.stages.__file__).parent


def _ledger_uses(path: Path) -> set[tuple[str, str]]:
    found = set()
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                isinstance(n, ast.Attribute) and n.attr == "ledger" for n in ast.walk(function)):
            found.add((path.relative_to(STAGES_DIR).as_posix(), function.name))
    return found


def test_no_stage_reaches_the_ledger_but_through_the_service() -> None:
    paths = sorted(STAGES_DIR.rglob("*.py"))
    assert {p.name for p in paths} >= {"soak.py", "gated.py", "scale.py", "warmup.py", "soak_recovery.py"}
    found = set().union(*(_ledger_uses(p) for p in paths))
    assert not found, f"stages using .ledger directly: {sorted(found)}"


def _service(tmp_path: Path) -> AttemptService:
    (tmp_path / "inv.ini").write_text("[g]\nnode1 ansible_host=10.90.0.11\n[g:vars]\nstepdeploy_gpus_per_node=0\n")
    config = RolloutConfig(inventory=str(tmp_path / "inv.ini"), model="tiny-dense", stages=("warmup", "soak"))
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.create_run("r", config.to_json(), list(config.stages))
    return AttemptService(tmp_path, ledger, "r", config, load_cluster(config.inventory))


def test_the_soak_reads_back_what_the_warmup_recorded_typed(tmp_path: Path) -> None:
    service = _service(tmp_path)
    assert TargetStep.measured(service) == TargetStep()  # no warm-up ran
    step_s, source = TargetStep().step(service.cluster, service.config)
    assert source.startswith("assumed") and step_s > 0  # CPU nodes: no plan
    run = tmp_path / "attempts" / "warmup-target-a1"
    attempt = service.start_attempt("warmup", "target", {"local_run": str(run), "plan": {"predicted_step_s": 0.5}})
    started = service.attempts("warmup")[0]["started"]
    out = run / "fetched" / "nodes" / "0-node1" / "out"
    out.mkdir(parents=True)
    (out / "phases.jsonl").write_text(json.dumps({"phase": "first_step", "time": started + 7.5, "pid": 1}) + "\n")
    assert TargetStep.measured(service).step(service.cluster, service.config) == (0.5, "the planner's prediction")
    service.finish_attempt(attempt, "passed", {})
    TargetStep(first_step_s=3.0, steady_step_s=0.25).record(service)
    measured = TargetStep.measured(service)
    assert measured == TargetStep(first_step_s=3.0, steady_step_s=0.25, startup_s=7.5, predicted_step_s=0.5)
    assert measured.step(service.cluster, service.config) == (0.25, "measured in the warm-up")
    (event,) = service.events("warmup", kind="warmup")  # what the report shows, as before
    assert event["message"] == "first step 3.0 s, steady step 0.25 s" and event["data"]["steady_step_s"] == 0.25
