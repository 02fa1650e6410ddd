"""The crash's culprit when a poll finds several ranks dead at once: the rank whose launcher (launch_ranks.py) saw
it fail first, by its record's time, never by rank; ranks the launcher stopped after it are victims. Under Slurm,
srun --kill-on-bad-exit SIGKILLs every node's task ~50 ms after the first node's launcher exits, so one poll finds
the killed rank and the ranks srun killed for it dead together (CI, 2026-12-06, blamed node1 rank 0)."""

from __future__ import annotations

import pytest

from stepdeploy.monitor.classify import classify
from stepdeploy.remote.executor import NodeStatus, RankStatus, RunStatus

KILLED = ("was killed by signal 9 (SIGKILL), seen by its launcher first on its node; no exit record of its own")


def _run(*ranks: RankStatus) -> RunStatus:
    nodes = tuple(NodeStatus(node, "exited", 137, tuple(r for r in ranks if r.node == node))
                  for node in sorted({r.node for r in ranks}))
    return RunStatus(nodes)


def _rank(rank: int, node: str, state: str = "died", code: int | None = None, reason: str = "",
          failed_first_at: float | None = None, stopped_after_rank: int | None = None) -> RankStatus:
    return RankStatus(rank, node, 1000 + rank, state, code, reason, iteration=5, heartbeat_age_s=1.0,
                      failed_first_at=failed_first_at, stopped_after_rank=stopped_after_rank)


def test_the_rank_its_launcher_saw_die_is_the_crash_not_the_lowest_rank_killed_with_it() -> None:
    srun_killed = _rank(0, "node1")  # its launcher was SIGKILLed with it: no record, status "running", pid gone
    killed = _rank(1, "node2", code=137, reason=KILLED, failed_first_at=1000.0)
    for ranks in ((srun_killed, killed), (killed, srun_killed)):
        result = classify(_run(*ranks))
        assert (result.kind, result.node, result.rank) == ("crash", "node2", 1)
        assert result.evidence[0] == (f"rank 1 on node2: died without exiting (pid 1001 gone; {KILLED}), "
                                      "last heartbeat at iteration 5")
        assert result.evidence[1].startswith("rank 0 on node1: died without exiting (pid 1000 gone; killed or crashed)")


def test_without_launcher_records_torchruns_tie_break_is_unchanged() -> None:
    result = classify(_run(_rank(0, "node1"), _rank(1, "node2")))
    assert (result.node, result.rank) == ("node1", 0)  # same iteration: the lowest rank, as before


@pytest.mark.parametrize(("node1_at", "node2_at", "culprit"), [(1000.05, 1000.0, 1), (1000.0, 1000.05, 0)])
def test_the_earliest_record_wins_when_both_launchers_wrote_one(node1_at: float, node2_at: float,
                                                               culprit: int) -> None:
    """node1's launcher may see its worker SIGKILLed by srun and record it too, a moment later."""
    result = classify(_run(_rank(0, "node1", code=137, reason=KILLED, failed_first_at=node1_at),
                           _rank(1, "node2", code=137, reason=KILLED, failed_first_at=node2_at)))
    assert result.rank == culprit


def test_a_rank_killed_first_beats_a_later_rank_with_its_own_error() -> None:
    """Without records a rank exiting with its own error wins over a died one; the record's time says more."""
    own_error = _rank(0, "node1", "exited", 1, "RuntimeError: boom", failed_first_at=1000.2)
    killed = _rank(1, "node2", code=137, reason=KILLED, failed_first_at=1000.0)
    assert classify(_run(own_error, killed)).rank == 1
    assert classify(_run(_rank(0, "node1", "exited", 1, "RuntimeError: boom"), _rank(1, "node2"))).rank == 0


def test_ranks_the_launcher_stopped_after_the_first_failure_are_victims() -> None:
    """node2's rank 3 ignored SIGTERM and was SIGKILLed after the grace: died, but stopped after rank 2."""
    first = _rank(2, "node2", "exited", 1, "ValueError: bad batch", failed_first_at=1000.0)
    stopped = _rank(3, "node2", code=137, stopped_after_rank=2,
                    reason="was killed by signal 9 (SIGKILL), stopped by its launcher after rank 2 failed; "
                           "no exit record of its own")
    result = classify(_run(_rank(0, "node1", "exited", 3), _rank(1, "node1", "exited", 3), first, stopped))
    assert (result.node, result.rank) == ("node2", 2)
    assert not [line for line in result.evidence if line.startswith("rank 3 ")]
    assert classify(_run(_rank(0, "node1", "exited", 143), stopped)) is None  # a victim alone is no crash


def test_culprits_name_the_earliest_recorded_failure_first_and_leave_victims_out() -> None:
    status = _run(_rank(0, "node1"), _rank(1, "node2", code=137, reason=KILLED, failed_first_at=1000.0),
                  _rank(2, "node2", "exited", 137, "stopped", stopped_after_rank=1))
    assert status.culprits() == [f"node node2 rank 1: died without exiting (pid 1001 gone; {KILLED})",
                                 "node node1 rank 0: died without exiting (pid 1000 gone; killed or crashed)"]
