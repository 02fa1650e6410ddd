"""Issue 36 item 7: an attempt that never launched spends no restart. Each soak attempt whose launch succeeded
records a `launched` event; `spent_restarts` counts only the failures of attempts that launched (an attempt of a
ledger written before launches were recorded counts when it failed, as it did then)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepdeploy.rollout.stages.soak import LAUNCH_MARKED, spent_restarts
from tests.unit.rollout.test_soak_state_machine import _soak


class ControllerKilled(BaseException):  # like SIGKILL: nothing of the controller's runs after it
    pass


def _die() -> None:
    raise ControllerKilled


def test_a_controller_killed_before_the_launch_spends_no_restart(tmp_path: Path) -> None:
    s = _soak(tmp_path, soak_max_restarts=1)
    s.nodes.on("prepare", _die)  # killed while uploading: the attempt is in the ledger, nothing runs
    with pytest.raises(ControllerKilled):
        s.rollout().run()
    assert s.attempts() == ["running"] and not s.nodes.starts and not s.events("launched")
    s.nodes.at(start=1, after_s=20, kill=1)  # the first real start fails once: the one restart the budget allows
    assert s.run() is None, "the attempt that never launched spent the only restart"
    assert s.attempts() == ["failed", "failed", "passed"] and len(s.nodes.starts) == 2
    launched = [e["data"]["attempt"] for e in s.events("launched")]
    ids = [a["id"] for a in s.ledger.attempts("r")]
    assert launched == ids[1:], "one launched event per attempt that launched"
    assert [a["detail"]["restart"] for a in s.ledger.attempts("r")] == [0, 0, 1]
    assert [e["data"]["restart"] for e in s.events("restart")] == [1]


def test_with_the_old_count_the_same_soak_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above can fail: counting every failed attempt (the old rule) ends the same soak at its limit."""
    monkeypatch.setattr("stepdeploy.rollout.stages.soak.spent_restarts",
                        lambda attempts, launched: [a for a in attempts if a["status"] == "failed"])
    s = _soak(tmp_path, soak_max_restarts=1)
    s.nodes.on("prepare", _die)
    with pytest.raises(ControllerKilled):
        s.rollout().run()
    s.nodes.at(start=1, after_s=20, kill=1)
    why = s.run()
    assert why and why.startswith("soak: unrecovered failure after 1 restart(s)"), why


def test_a_refused_launch_records_no_launched_event(tmp_path: Path) -> None:
    s = _soak(tmp_path)
    s.nodes.fail("start", "node2", "unreachable: TimeoutError: timed out")
    assert s.run() is not None
    assert s.attempts() == ["failed"] and not s.events("launched")
    assert spent_restarts(s.ledger.attempts("r"), set()) == []


def _attempt(n: int, status: str, marked: bool) -> dict[str, Any]:
    return {"id": n, "status": status, "detail": {LAUNCH_MARKED: True} if marked else {}}


def test_spent_restarts_counts_the_failures_of_launched_attempts_and_old_ones() -> None:
    attempts = [_attempt(1, "failed", False),  # a ledger written before launches were recorded: counts
                _attempt(2, "failed", True),  # launched, then failed: counts
                _attempt(3, "failed", True),  # never launched: spends nothing
                _attempt(4, "passed", True), _attempt(5, "running", True), _attempt(6, "stopped", False)]
    assert [a["id"] for a in spent_restarts(attempts, {2, 4, 5})] == [1, 2]
