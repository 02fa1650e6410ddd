"""The controller's verdict on a failed run: the rank that died is named before the ranks it took down."""

from stepdeploy.remote.executor import NodeStatus, RankStatus, RunStatus


def test_killed_rank_is_the_culprit_not_its_victim() -> None:
    status = RunStatus((
        NodeStatus("node1", "exited", 1, (RankStatus(0, "node1", 10, "exited", 3, "collective failed: closed"),)),
        NodeStatus("node2", "exited", 1, (RankStatus(1, "node2", 11, "died"),)),
    ))
    assert not status.running and not status.finished_ok
    assert status.culprits() == ["node node2 rank 1: died without exiting (pid 11 gone; killed or crashed)"]


def test_unreachable_node_comes_first_and_victims_are_named_when_nothing_else_is_known() -> None:
    status = RunStatus((
        NodeStatus("node1", "exited", 1, (RankStatus(0, "node1", 10, "exited", 3, "collective failed"),)),
        NodeStatus("node2", "unreachable", detail="timed out"),
    ))
    assert status.culprits() == ["node node2: unreachable (timed out)"]
    only_victims = RunStatus((NodeStatus("n", "exited", 1, (RankStatus(0, "n", 1, "exited", 3, "timeout"),)),))
    assert only_victims.culprits() == ["node n rank 0: exited 3 (timeout)"]


def test_a_clean_finish_has_no_culprit() -> None:
    status = RunStatus((NodeStatus("n", "exited", 0, (RankStatus(0, "n", 1, "exited", 0, "finished"),)),))
    assert status.finished_ok and status.culprits() == []


def test_a_node_silent_for_less_than_the_timeout_is_not_yet_lost() -> None:
    """Issue 36 item 7: a 20 s blip must not count as a node loss when the heartbeat timeout is longer."""
    running = NodeStatus("node1", "running", ranks=(RankStatus(0, "node1", 10, "running"),))

    def silent(s: float | None) -> NodeStatus:
        return NodeStatus("node2", "unreachable", detail="silent", silent_s=s)

    assert RunStatus((running, silent(20.0))).lost_nodes(60.0) == []
    assert [n.node for n in RunStatus((running, silent(60.0))).lost_nodes(60.0)] == ["node2"]
    assert [n.node for n in RunStatus((running, silent(None))).lost_nodes(60.0)] == ["node2"]  # not measured


def test_when_no_node_answers_the_timeout_is_waited_out_too() -> None:
    """A one-node run whose link blips, or every node silent (the controller's own link): nothing tells a blip from a
    loss before the heartbeat timeout, so it is waited out as for one silent node (issue 36 item 7)."""
    def silent(name: str, s: float | None) -> NodeStatus:
        return NodeStatus(name, "unreachable", detail="silent", silent_s=s)

    assert RunStatus((silent("node1", 20.0),)).lost_nodes(60.0) == []
    assert RunStatus((silent("node1", 1.0), silent("node2", 1.0))).lost_nodes(60.0) == []
    assert [n.node for n in RunStatus((silent("node1", 60.0),)).lost_nodes(60.0)] == ["node1"]
    both = RunStatus((silent("node1", 61.0), silent("node2", 59.0))).lost_nodes(60.0)
    assert [n.node for n in both] == ["node1"]
    assert [n.node for n in RunStatus((silent("node1", None),)).lost_nodes(60.0)] == ["node1"]  # not measured
