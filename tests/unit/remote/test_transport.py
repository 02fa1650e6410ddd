"""The one transport: the same channels and defaults for preflight and the executors (the SSH user included),
a deadline per command that leaves nothing of the command behind, a per-node result map with a deadline for
all, and the environment a local run gets. Commands run on this machine only; no connection is made."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stepdeploy.inventory.model import Cluster, Node, SshSettings
from stepdeploy.preflight import runner
from stepdeploy.remote import registry, transport
from stepdeploy.remote.ssh import endpoint_for
from stepdeploy.remote.transport import LocalChannel, SshChannel


def test_preflight_and_the_executors_reach_a_node_the_same_way(tmp_path: Path) -> None:
    """Preflight used to default to root and the executors to the local user: a node that passed preflight
    could refuse the launch. Now both leave the user to ssh (ansible_user, else ~/.ssh/config, else ours)."""
    plain = Node(name="n1", address="10.0.0.1")
    assert endpoint_for(plain).user is None
    named = Node(name="n1", address="10.0.0.1", ssh=SshSettings(user="ops", port=2222))
    for node in (plain, named):
        preflight = transport.channel_for(node)
        manifest = {"run_id": "r1", "run_dir": "/runs/r1", "nodes": [{"name": "n1", "dir": "nodes/0-n1"}]}
        [target] = registry.create(manifest, Cluster(source=Path("x"), nodes=[node]), tmp_path).targets
        assert isinstance(preflight, SshChannel) and isinstance(target.channel, SshChannel)
        assert preflight.endpoint == target.channel.endpoint == endpoint_for(node)


def test_local_hosts_and_local_preflight_use_the_local_channel() -> None:
    assert isinstance(transport.channel_for(runner.this_machine()), LocalChannel)
    assert isinstance(transport.channel_for(Node(name="n1", address="10.0.0.1"), local=True), LocalChannel)


def test_a_command_past_its_deadline_is_killed_with_everything_it_started(tmp_path: Path) -> None:
    marker = tmp_path / "still-running"
    started = time.monotonic()
    ran = LocalChannel("n1").run(f"(sleep 3; touch {marker}) & sleep 30", timeout_s=0.5)
    assert ran.timed_out and ran.rc == transport.TIMED_OUT_RC and time.monotonic() - started < 10
    time.sleep(3.5)
    assert not marker.exists(), "a child of the timed-out command outlived it"


def test_local_put_refuses_a_planted_link_and_writes_private_files(tmp_path: Path) -> None:
    channel = LocalChannel("n1")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        channel.put(b"x", str(tmp_path / "link"))
    assert not (tmp_path / "elsewhere").exists()
    channel.put(b"data", str(tmp_path / "file"))
    assert channel.get(str(tmp_path / "file")) == b"data" and (tmp_path / "file").stat().st_mode & 0o077 == 0


def test_each_answers_per_node_and_does_not_wait_for_a_hung_one() -> None:
    class Item:
        def __init__(self, name: str) -> None:
            self.name = name

    def work(item: Item) -> str:
        if item.name == "hung":
            time.sleep(5)
        if item.name == "broken":
            raise ConnectionError("refused")
        return f"{item.name} ok"

    started = time.monotonic()
    answers = transport.each([Item("a"), Item("broken"), Item("hung")], work, deadline_s=0.5)
    assert time.monotonic() - started < 3
    assert list(answers) == ["a", "broken", "hung"] and answers["a"] == "a ok"
    assert isinstance(answers["broken"], ConnectionError) and isinstance(answers["hung"], TimeoutError)


def test_a_local_run_gets_a_login_like_environment() -> None:
    env = transport.session_environment({"PATH": "/usr/bin", "HOME": "/root", "PYTHONPATH": "/checkout",
                                         "VIRTUAL_ENV": "/venv", "NCCL_NVLS_ENABLE": "0", "LC_ALL": "C.UTF-8",
                                         "CUDA_VISIBLE_DEVICES": "0", "STEPDEPLOY_RUN_ID": "other"})
    assert env == {"PATH": "/usr/bin", "HOME": "/root", "NCCL_NVLS_ENABLE": "0", "LC_ALL": "C.UTF-8",
                   "CUDA_VISIBLE_DEVICES": "0"}
    assert "PATH" in transport.session_environment({})
    ran = LocalChannel("n1", env=transport.session_environment({**os.environ, "PYTHONPATH": "/x"})).run("env")
    assert ran.ok and "PYTHONPATH=" not in ran.stdout
