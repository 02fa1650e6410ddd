"""A layout that needs more than the stock stack (context parallelism: TransformerEngine) is verified on the nodes
before each launch, with preflight's own check, through the rollout's state machine on stepdeploy.testing's scripted
executor. The megatron engine does not run CP today (render refuses it: data/engines.yaml); the `te_engine` fixture
is the engine the day it does, so that the path from render's manifest to the nodes is held now."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from stepdeploy.cli.app import main
from stepdeploy.inventory import load_cluster
from stepdeploy.ledger import Ledger
from stepdeploy.plan import engines
from stepdeploy.preflight import probe
from stepdeploy.remote.executor import CommandResult
from stepdeploy.render.manifest import Manifest
from stepdeploy.rollout.config import RolloutConfig, StageFailed
from stepdeploy.rollout.runner import Rollout
from stepdeploy.rollout.stages import needs
from stepdeploy.testing import FakeClock, FakeNodes

INVENTORY = ("[gpu]\nnode1 ansible_host=10.9.0.11\nnode2 ansible_host=10.9.0.12\n"
             "[gpu:vars]\nstepdeploy_gpus_per_node=2\nstepdeploy_gpu_model=H200\nstepdeploy_fabric=ethernet\n")
BASE = RolloutConfig(inventory="", model="tiny-dense", stages=("warmup",), warmup_iterations=10, soak_duration_s=60.0,
                     checkpoint_interval=5, poll_interval_s=1.0, monitor_interval_s=5.0, heartbeat_timeout_s=30.0,
                     node_wait_s=60.0)
PYTHON_SECTION = r"exec \"\$p\" -I -c"  # probe.python_command's own words (no other command has them)
WITH_TE = json.dumps({"python": "3.12.3", "executable": "/opt/stepdeploy/venv/bin/python", "torch": "2.9.0",
                      "transformer_engine": "2.8.0", "transformer_engine_error": None})
WITHOUT_TE = json.dumps({"python": "3.12.3", "executable": "/opt/stepdeploy/venv/bin/python", "torch": "2.9.0",
                         "transformer_engine": None})


@pytest.fixture
def te_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The megatron engine as it would be with TransformerEngine's attention: context parallelism runs."""
    caps = copy.deepcopy(engines.capabilities())
    caps["megatron"]["context_parallel"]["runs"] = True
    monkeypatch.setattr(engines, "capabilities", lambda: caps)


def _rollout(tmp_path: Path, answer: str | None, *, down: str | None = None, **config: Any
             ) -> tuple[Ledger, FakeNodes, str | None]:
    """Drive the rollout on scripted nodes whose python section answers `answer` (None: as the fake answers any
    command; `down`: a node whose every command fails); the StageFailed's message when it failed."""
    (tmp_path / "inv.ini").write_text(INVENTORY)
    clock = FakeClock()
    cfg = replace(BASE, inventory=str(tmp_path / "inv.ini"), **config).checked()
    (tmp_path / "r").mkdir()
    ledger = Ledger(tmp_path / "r" / "ledger.sqlite", clock=clock.time)
    ledger.create_run("r", cfg.to_json(), list(cfg.stages))
    nodes = FakeNodes(clock)
    if answer is not None:
        nodes.respond(PYTHON_SECTION, answer + "\n")
    if down is not None:
        nodes.fail("run_command", down, f"ssh: connect to host {down} port 22: No route to host")
    try:
        Rollout(tmp_path / "r", ledger, "r", cfg, cluster=load_cluster(cfg.inventory), clock=clock.clock,
                executors=nodes.executor).run()
    except StageFailed as exc:
        return ledger, nodes, exc.message
    return ledger, nodes, None


def _checks(nodes: FakeNodes) -> list[str]:
    return [node for node, command in nodes.commands if command == probe.python_command(
        ("/opt/stepdeploy/venv/bin/python",))]


@pytest.mark.usefixtures("te_engine")
def test_a_cp_layout_launches_once_every_node_has_transformer_engine(tmp_path: Path) -> None:
    ledger, nodes, failed = _rollout(tmp_path, WITH_TE, layout="cp=2")
    assert failed is None and ledger.run("r")["status"] == "passed", failed
    assert _checks(nodes) == ["node1", "node2"]
    assert nodes.calls.index("run_command") < nodes.calls.index("start")  # verified before the launch
    (event,) = [e for e in ledger.events("r") if e["kind"] == "needs"]
    assert "node1 2.8.0: the layout's need is met" in event["message"] and event["stage"] == "warmup"


@pytest.mark.usefixtures("te_engine")
def test_a_cp_layout_without_transformer_engine_fails_before_anything_starts(tmp_path: Path) -> None:
    ledger, nodes, failed = _rollout(tmp_path, WITHOUT_TE, layout="cp=2")
    assert failed is not None
    assert "warmup/target: the layout tp=1,pp=1,cp=2 needs transformer_engine" in failed
    assert "node1: transformer_engine not installed" in failed and "node2: transformer_engine not installed" in failed
    assert "start" not in nodes.calls and nodes.starts == []
    (attempt,) = ledger.attempts("r")
    assert attempt["status"] == "failed" and "transformer_engine not installed" in attempt["detail"]["why"]
    assert ledger.stages("r")[0].status == "failed" and ledger.run("r")["status"] == "failed"


@pytest.mark.usefixtures("te_engine")
def test_a_node_that_does_not_answer_the_check_is_named(tmp_path: Path) -> None:
    ledger, nodes, failed = _rollout(tmp_path, WITH_TE, down="node2", layout="cp=2", stages=("soak",))
    assert failed is not None
    assert "node2: python the run's python did not answer: ssh: connect to host node2" in failed
    assert "node1:" not in failed  # node1 answered and has it
    assert "start" not in nodes.calls  # the soak launched nothing either
    assert [a["status"] for a in ledger.attempts("r")] == ["failed"]


def test_a_layout_that_needs_nothing_more_runs_no_check(tmp_path: Path) -> None:
    ledger, nodes, failed = _rollout(tmp_path, None, layout="tp=2")
    assert failed is None and ledger.run("r")["status"] == "passed", failed
    assert _checks(nodes) == [] and not [e for e in ledger.events("r") if e["kind"] == "needs"]


def test_the_check_is_preflights_over_each_nodes_answer() -> None:
    software = ("transformer_engine: TransformerEngine's attention",)
    answers = [CommandResult("node1", True, 0, WITH_TE + "\n"), CommandResult("node2", True, 0, WITHOUT_TE + "\n"),
               CommandResult("node3", False, 127, "no python found\n")]
    results = needs.judge(answers, software)
    assert [(r.node, r.check, r.status.value) for r in results] == [
        ("node1", "transformer_engine", "ok"), ("node2", "transformer_engine", "fail"), ("node3", "python", "fail")]
    assert "no python found" in results[2].observed


@pytest.mark.usefixtures("te_engine")
def test_render_writes_what_the_layout_needs_into_the_manifest(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "inv.ini").write_text(INVENTORY)
    with pytest.raises(SystemExit) as exit_info:
        main(["render", "-i", str(tmp_path / "inv.ini"), "-m", "tiny-dense", "--layout", "cp=2", "--python", "python3",
              "--out", str(tmp_path / "run")])
    assert not exit_info.value.code
    manifest = Manifest.load(tmp_path / "run")
    assert manifest.needs is not None and manifest.needs.python == "python3"
    assert manifest.needs.software == ["transformer_engine: TransformerEngine's attention (any cp_comm_type: p2p, "
                                       "a2a, all_gather)"]
    assert "layout tp=1,pp=1,cp=2 needs on every node: transformer_engine" in capsys.readouterr().err


def test_a_run_that_needs_nothing_more_has_no_needs_in_its_manifest(tmp_path: Path) -> None:
    (tmp_path / "inv.ini").write_text(INVENTORY)
    with pytest.raises(SystemExit) as exit_info:
        main(["render", "-i", str(tmp_path / "inv.ini"), "-m", "tiny-dense", "--out", str(tmp_path / "run")])
    assert not exit_info.value.code
    assert Manifest.load(tmp_path / "run").needs is None
    assert "needs" not in json.loads((tmp_path / "run" / "manifest.json").read_text())


@pytest.mark.usefixtures("te_engine")
def test_the_dry_run_says_what_the_given_layout_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "inv.ini").write_text(INVENTORY)
    with pytest.raises(SystemExit) as exit_info:
        main(["rollout", "run", "-i", str(tmp_path / "inv.ini"), "-m", "tiny-dense", "--layout", "cp=2",
              "--stages", "warmup", "--run-dir", str(tmp_path / "r"), "--dry-run"])
    assert not exit_info.value.code
    printed = json.loads(capsys.readouterr().out)
    assert printed["needs"]["software"][0].startswith("transformer_engine: ")
