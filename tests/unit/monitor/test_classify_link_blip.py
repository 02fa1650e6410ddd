"""A node whose link blips for less than the heartbeat timeout is no failure (issue 36 item 7): the pure classifier
on a 2-node run's polls (n1: ranks 0-1, n2: ranks 2-3). A silence that lasts the timeout is a node loss, and one the
run does not ride out (the peers' collectives fail, or they hang past the timeout, while the node is silent) is the
silent node's loss at once -- never a `link` or a `hang` of the ranks that only waited on it."""

from __future__ import annotations

from stepdeploy.monitor.classify import classify
from stepdeploy.monitor.model import Finding, Severity
from stepdeploy.remote.executor import EXITED, RUNNING, UNREACHABLE, NodeStatus, RankStatus, RunStatus

TIMEOUT = 60.0
POLL_S = 2.0
NOTICED_S = 12.0  # a silent node is first answered unreachable when a poll fails: up to a poll and its timeout late


def _rank(rank: int, state: str = RUNNING, code: int | None = None, age: float = 1.0) -> RankStatus:
    return RankStatus(rank, "n1" if rank < 2 else "n2", 1000 + rank, state, code, "", 100, age)


def _node(name: str, *ranks: RankStatus) -> NodeStatus:
    state = RUNNING if any(r.state == RUNNING for r in ranks) else EXITED
    return NodeStatus(name, state, None if state == RUNNING else 3, ranks)


def _silent(name: str, silent_s: float | None) -> NodeStatus:
    return NodeStatus(name, UNREACHABLE, detail=f"TimeoutError: timed out (silent for {silent_s or 0:.0f} s)",
                      silent_s=silent_s)


def _n2_silent(silent_s: float | None, *n1: RankStatus) -> RunStatus:
    return RunStatus((_node("n1", *(n1 or (_rank(0), _rank(1)))), _silent("n2", silent_s)))


def test_a_node_silent_for_20_s_is_no_failure() -> None:
    waiting = (_rank(0, age=25.0), _rank(1, age=25.0))  # blocked in a collective on n2's ranks since the blip began
    assert classify(_n2_silent(20.0, *waiting), heartbeat_timeout_s=TIMEOUT) is None
    assert classify(_n2_silent(20.0, *waiting)) is None  # the default timeout (180 s)
    assert classify(_n2_silent(0.0)) is None  # the first poll that found it silent


def test_a_blip_that_the_run_rides_out_is_no_failure_at_any_poll() -> None:
    """20 s down, then n2 answers and its ranks train on: no poll of the blip says failure."""
    polls = [_n2_silent(t - NOTICED_S, _rank(0, age=t + 1), _rank(1, age=t + 1))
             for t in range(int(NOTICED_S), 21, int(POLL_S))]
    polls.append(RunStatus((_node("n1", _rank(0), _rank(1)), _node("n2", _rank(2), _rank(3)))))
    assert [classify(p, heartbeat_timeout_s=TIMEOUT) for p in polls] == [None] * len(polls)


def test_a_node_silent_past_the_timeout_is_a_node_loss_within_the_timeout() -> None:
    """The node stays away. Peers that train on without it (its silence is the controller's link only): node-loss at
    the first poll whose silence reaches the timeout. Peers that wait on it: node-loss once they have waited the
    timeout, which they began to before the poll noticed the silence -- never a hang of theirs first."""
    def first_verdict(peers_wait: bool) -> tuple[float, object]:
        t = NOTICED_S
        while True:
            age = t + 1.0 if peers_wait else 1.0
            verdict = classify(_n2_silent(t - NOTICED_S, _rank(0, age=age), _rank(1, age=age)),
                               heartbeat_timeout_s=TIMEOUT)
            if verdict is not None:
                return t - NOTICED_S, verdict
            t += POLL_S

    silent_s, verdict = first_verdict(peers_wait=False)
    assert silent_s == TIMEOUT and (verdict.kind, verdict.node, verdict.rank) == ("node-loss", "n2", None)
    assert verdict.evidence == ("node n2 unreachable: TimeoutError: timed out (silent for 60 s)",)
    silent_s, verdict = first_verdict(peers_wait=True)
    assert silent_s < TIMEOUT and (verdict.kind, verdict.node) == ("node-loss", "n2"), verdict
    assert verdict.evidence[2:] == ("rank 0 on n1: no heartbeat for 61 s, at iteration 100",
                                    "rank 1 on n1: no heartbeat for 61 s, at iteration 100")


def test_collectives_that_time_out_during_a_silence_are_its_node_loss_not_a_link() -> None:
    """The peers' collectives timed out (exit 3) while n2 is silent for 20 s: the run is down and n2's silence is
    why; a `link` verdict would restart at once onto a node that does not answer."""
    verdict = classify(_n2_silent(20.0, _rank(0, EXITED, 3), _rank(1, EXITED, 3)), heartbeat_timeout_s=TIMEOUT)
    assert (verdict.kind, verdict.node, verdict.rank) == ("node-loss", "n2", None)
    assert verdict.evidence == ("node n2 unreachable: TimeoutError: timed out (silent for 20 s)",
                                "the run did not ride out the silence (under the 60 s timeout):",
                                "rank 0 on n1: exited 3 (collective failed)",
                                "rank 1 on n1: exited 3 (collective failed)")
    # once n2 answers and its ranks' collectives failed too, nothing is silent: the network between the nodes
    back = RunStatus((_node("n1", _rank(0, EXITED, 3), _rank(1, EXITED, 3)),
                      _node("n2", _rank(2, EXITED, 3), _rank(3, EXITED, 3))))
    assert classify(back, heartbeat_timeout_s=TIMEOUT).kind == "link"


def test_a_hang_reported_during_a_silence_is_its_node_loss() -> None:
    hang = Finding("hang", Severity.FAIL, "rank 0", "no heartbeat for 70 s", node="n1")
    verdict = classify(_n2_silent(20.0), [hang], heartbeat_timeout_s=TIMEOUT)
    assert (verdict.kind, verdict.node) == ("node-loss", "n2")
    assert verdict.evidence[-1] == "monitor: n1 rank 0: no heartbeat for 70 s"


def test_a_cause_of_its_own_during_a_blip_is_still_named() -> None:
    """A rank killed on n1, or one that failed with its own error, while n2 blips is a crash on that rank (it did not
    wait on n2), also when its peer's collective failed because of it."""
    verdict = classify(_n2_silent(20.0, _rank(0, "died"), _rank(1, age=20.0)), heartbeat_timeout_s=TIMEOUT)
    assert (verdict.kind, verdict.node, verdict.rank) == ("crash", "n1", 0)
    verdict = classify(_n2_silent(20.0, _rank(0, EXITED, 1), _rank(1, EXITED, 3)), heartbeat_timeout_s=TIMEOUT)
    assert (verdict.kind, verdict.node, verdict.rank) == ("crash", "n1", 0)


def test_a_run_that_ended_where_it_answers_while_a_node_is_silent_is_its_node_loss() -> None:
    """n1's ranks are gone (the end of the follow) while n2 is silent: nothing rode the silence out, and the
    controller cannot see how n2's part ended."""
    verdict = classify(_n2_silent(20.0, _rank(0, EXITED, 0), _rank(1, EXITED, 143)), heartbeat_timeout_s=TIMEOUT)
    assert (verdict.kind, verdict.node) == ("node-loss", "n2")
    assert verdict.evidence[-1] == "no rank runs any more on n1 (exit codes 0, 143)"


def test_a_silence_not_measured_is_lost_at_once() -> None:
    """RunStatus.lost_nodes' rule: no silence measured (silent_s None: the node answered, its probe failed)."""
    assert classify(_n2_silent(None), heartbeat_timeout_s=TIMEOUT).kind == "node-loss"


def test_when_no_node_answers_the_timeout_is_waited_out() -> None:
    """Every node silent (a one-node run's blip, or the controller's own link): nothing shows whether the run rides
    it out, so the silence is a node loss at the heartbeat timeout, as for one silent node -- not at once."""
    one_node = RunStatus((_silent("n1", 20.0),))
    assert classify(one_node, heartbeat_timeout_s=TIMEOUT) is None
    assert classify(RunStatus((_silent("n1", 5.0), _silent("n2", 5.0))), heartbeat_timeout_s=TIMEOUT) is None
    verdict = classify(RunStatus((_silent("n1", TIMEOUT),)), heartbeat_timeout_s=TIMEOUT)
    assert (verdict.kind, verdict.node) == ("node-loss", "n1")
    everyone = RunStatus((_silent("n1", TIMEOUT), _silent("n2", TIMEOUT)))
    verdict = classify(everyone, heartbeat_timeout_s=TIMEOUT)
    assert (verdict.kind, verdict.node) == ("node-loss", "n1") and len(verdict.evidence) == 2
