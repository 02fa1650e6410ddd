"""Issue 36 item 7: every SSH operation is bounded as a whole, connecting and opening the session included, so a
node whose link goes silent never blinds the controller. A real SSH server (paramiko's server side, in this
process) behind a relay whose link can go silent (tests/unit/remote/silent_link.py): no reset, no FIN, nothing
answered, as a pulled cable. Before the bounds, a command on a kept connection waited an hour for its session to
open (paramiko's channel timeout), and polls stopped for as long as the link was down."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from remote.silent_link import Link  # tests/unit is on sys.path, as for fuzz.harness

from stepdeploy.remote.executor import UNREACHABLE, Target
from stepdeploy.remote.node_executor import POLL_DEADLINE_S, NodeExecutor
from stepdeploy.remote.transport import TIMED_OUT_RC, LocalChannel, SshChannel, SshTimeout

SLACK_S = 3.0  # thread start-up and the transport thread noticing the close, on a loaded 2-core box


@pytest.fixture
def link(tmp_path: Path) -> Iterator[Link]:
    made = Link(tmp_path)
    try:
        yield made
    finally:
        made.close()


def timed(call):  # type: ignore[no-untyped-def]
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def test_the_server_answers_while_the_link_is_up(link: Link) -> None:
    channel = SshChannel("n1", link.endpoint, connect_timeout_s=5)
    try:
        ran = channel.run("echo hello; exit 3", timeout_s=20)
        assert (ran.rc, ran.stdout) == (3, "hello\n")
    finally:
        channel.close()


def test_a_command_on_a_kept_connection_whose_link_goes_silent_is_bounded(link: Link) -> None:
    """The session's opening waited for paramiko's one-hour channel timeout; the command's own timeout started
    only after it."""
    channel = SshChannel("n1", link.endpoint, connect_timeout_s=5)
    try:
        assert channel.run("true", timeout_s=20).ok  # connected, the connection kept
        link.silent.set()
        ran, took = timed(lambda: channel.run("echo never", timeout_s=3))
        assert ran.timed_out and ran.rc == TIMED_OUT_RC, ran
        assert took <= 3 + 2 + SLACK_S, f"a 3 s command on a silent link took {took:.1f} s"
        link.silent.clear()  # the link is back: the next call connects again and answers
        again = channel.run("echo back", timeout_s=20)
        assert again.ok and again.stdout == "back\n", again
    finally:
        channel.close()


def test_connecting_to_a_silent_node_is_bounded_by_the_connect_timeout_plus_the_command(link: Link) -> None:
    """TCP connects (the relay accepts) but no banner ever comes: paramiko's banner wait alone was 15 s, its
    authentication 30 s."""
    link.silent.set()
    channel = SshChannel("n1", link.endpoint, connect_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(Exception) as raised:  # an SSH failure is the caller's "unreachable"
        channel.run("true", timeout_s=2)
    took = time.monotonic() - started
    channel.close()
    assert raised.value is not None
    assert took <= 2 + 2 + 2 + SLACK_S, f"took {took:.1f} s"


def test_a_transfer_on_a_silent_link_raises_within_its_timeout(link: Link) -> None:
    channel = SshChannel("n1", link.endpoint, connect_timeout_s=5)
    try:
        assert channel.run("true", timeout_s=20).ok
        link.silent.set()
        started = time.monotonic()
        with pytest.raises(SshTimeout):
            channel.get("/etc/hostname", timeout_s=3)
        assert time.monotonic() - started <= 3 + SLACK_S
        started = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 (reconnecting: the banner's timeout or the watchdog's)
            channel.put(b"x", "/nonexistent/never", timeout_s=2)
        assert time.monotonic() - started <= 2 + 5 + SLACK_S
    finally:
        channel.close()


def test_a_silent_node_never_holds_a_poll_round_and_is_not_tried_until_it_answers(link: Link, tmp_path: Path) -> None:
    """Polls go on while one node is silent: each round ends within POLL_DEADLINE_S with that node unreachable (how
    long it has been silent said), the other node's status in it; commands do not wait on the silent node."""
    run_dir = tmp_path / "run"
    for node in ("n1", "n2"):
        (run_dir / "nodes" / node).mkdir(parents=True)
    (run_dir / "out" / "status").mkdir(parents=True)
    silent = SshChannel("n1", link.endpoint, connect_timeout_s=5)
    targets = [Target("n1", silent, "nodes/n1"), Target("n2", LocalChannel("n2"), "nodes/n2")]
    with NodeExecutor("r1", str(run_dir), targets) as executor:
        first = executor.poll()
        assert [n.state for n in first.nodes] != [UNREACHABLE, UNREACHABLE], first
        assert first.nodes[0].state != UNREACHABLE, first.nodes[0]
        link.silent.set()
        rounds = []
        for _ in range(2):
            status, took = timed(executor.poll)
            rounds.append((status, took))
            assert took <= POLL_DEADLINE_S + SLACK_S, f"a poll round took {took:.1f} s"
        (one, _), (two, _) = rounds
        assert one.nodes[0].state == UNREACHABLE and one.nodes[1].state != UNREACHABLE, one
        assert two.nodes[0].silent_s is not None and two.nodes[0].silent_s >= one.nodes[0].silent_s >= 0
        assert "silent for" in two.nodes[0].detail
        results, took = timed(lambda: executor.run_command("echo hi"))
        assert took < 2, f"a command waited {took:.1f} s on a node the poll found silent"
        assert not results[0].ok and "not tried" in results[0].stderr and results[1].ok, results
        link.silent.clear()
        back = executor.poll()
        assert back.nodes[0].state != UNREACHABLE and back.nodes[0].silent_s is None, back.nodes[0]
        assert all(r.ok for r in executor.run_command("echo hi")), "the node answered a poll: it is tried again"
