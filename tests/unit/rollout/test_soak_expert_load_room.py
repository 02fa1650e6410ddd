"""An MoE soak too short for the expert_load gate is said before it runs: in the dry run's soak plan
(`expert_load_warning`) and in the soak's `schedule` event (the routers of a fresh MoE model collapse in its first
steps and recover over tens of them: docs/rollout.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepdeploy.cli.app import main
from stepdeploy.rollout.stages.soak import MOE_SETTLE_ITERATIONS, expert_load_room

CPU_PAIR = "[g]\nnode1 ansible_host=10.90.0.11\nnode2 ansible_host=10.90.0.12\n[g:vars]\nstepdeploy_gpus_per_node=0\n"


def test_a_short_moe_soak_is_warned_a_long_one_and_a_dense_one_are_not() -> None:
    warning = expert_load_room("tiny-moe", 39)
    assert warning is not None and warning.startswith("the soak's ~39 iterations may end before")
    assert f"{MOE_SETTLE_ITERATIONS}+ iterations" in warning
    assert expert_load_room("tiny-moe", MOE_SETTLE_ITERATIONS) is None
    assert expert_load_room("tiny-dense", 39) is None  # no expert_load gate


def _dry_run(capsys: pytest.CaptureFixture[str], tmp_path: Path, model: str, duration: str) -> dict:
    (tmp_path / "inv.ini").write_text(CPU_PAIR)
    with pytest.raises(SystemExit) as exit_info:
        main(["rollout", "run", "-i", str(tmp_path / "inv.ini"), "-m", model, "--stages", "soak",
              "--soak-duration", duration, "--run-dir", str(tmp_path / "r"), "--dry-run"])
    out = capsys.readouterr().out
    assert int(exit_info.value.code or 0) == 0, out
    assert not (tmp_path / "r").exists()
    return json.loads(out)["soak"]


def test_the_dry_run_says_it_from_the_planned_step(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # CPU nodes have no plan: 1.0 s a step is assumed, so 60 s is ~60 iterations and 1 h ~3,600
    short = _dry_run(capsys, tmp_path, "tiny-moe", "60s")
    assert "expert_load" in short["gates"]
    assert short["expert_load_warning"].startswith("the soak's ~60 iterations may end before")
    assert _dry_run(capsys, tmp_path, "tiny-moe", "1h")["expert_load_warning"] is None
    assert "expert_load_warning" not in _dry_run(capsys, tmp_path, "tiny-dense", "60s")
