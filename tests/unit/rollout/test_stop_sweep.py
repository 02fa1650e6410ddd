"""A run stopped with a save in flight leaves no staging directory behind (issue 36 item 6): once the stop is
proven on every node, the controller removes the uncommitted `.iter_N.tmp-*` directories a rank killed after the
stop's grace could not remove itself; while a process of the run may still be writing, it touches nothing."""

from __future__ import annotations

from pathlib import Path

from stepdeploy.remote.executor import CommandResult, StopResult
from stepdeploy.rollout.service import SWEEP_STAGING, stop_and_sweep
from stepdeploy.rollout.stages.soak_recovery import CLEAR_RANK_FILES


class Nodes:
    """Scripted: each node's stop result; commands recorded."""

    def __init__(self, stopped: dict[str, bool]) -> None:
        self.stopped = stopped
        self.commands: list[str] = []

    def stop(self, grace_s: float = 10.0, targets: object = None) -> list[StopResult]:
        return [StopResult(node, ok) for node, ok in self.stopped.items()]

    def run_command(self, command: str, targets: object = None) -> list[CommandResult]:
        self.commands.append(command)
        return [CommandResult(node, True, 0, "") for node in self.stopped]


def test_a_proven_stop_sweeps_the_uncommitted_staging_directories() -> None:
    nodes = Nodes({"node1": True, "node2": True})
    assert [r.ok for r in stop_and_sweep(nodes)] == [True, True]  # type: ignore[arg-type]
    assert nodes.commands == [SWEEP_STAGING]


def test_a_stop_that_left_a_process_touches_nothing() -> None:
    nodes = Nodes({"node1": True, "node2": False})
    stop_and_sweep(nodes)  # type: ignore[arg-type]
    assert nodes.commands == []


def test_the_sweep_removes_staging_only(tmp_path: Path) -> None:
    """The command itself, run by a real shell in a run directory: committed checkpoints and `latest` stay."""
    import subprocess

    ckpt = tmp_path / "out" / "checkpoints"
    for name in ("iter_0000020", ".iter_0000040.tmp-ab12cd-r0", ".iter_0000040.tmp-ab12cd"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "state.pt").write_bytes(b"x")
    (ckpt / "latest").write_text("20\n")
    subprocess.run(["sh", "-c", SWEEP_STAGING], cwd=tmp_path, check=True)
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000020", "latest"]
    assert CLEAR_RANK_FILES.endswith(SWEEP_STAGING)  # the soak's restart clears the same
