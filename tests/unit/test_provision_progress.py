"""Provisioning progress from ansible-runner events (the event shapes ansible-runner emits), and its
renderings: the live view and the recap, rendered into a string console."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from stepdeploy.cli.provision import live_view, render_recap
from stepdeploy.provision.progress import Progress
from stepdeploy.provision.runner import ProvisionResult


def _ev(event: str, **data: object) -> dict:
    return {"event": event, "event_data": data}


EVENTS = [
    _ev("playbook_on_play_start", play="Hardware facts and stack compatibility"),
    _ev("playbook_on_task_start", task="Gathering Facts"),
    _ev("runner_on_start", host="node1", task="Gathering Facts"),
    _ev("runner_on_ok", host="node1", task="Gathering Facts", res={"changed": False}),
    _ev("runner_on_ok", host="node2", task="Gathering Facts", res={"changed": False}),
    _ev("playbook_on_play_start", play="Provision the nodes"),
    _ev("playbook_on_task_start", task="Write limits"),
    _ev("runner_on_ok", host="node1", task="Write limits", role="common", res={"changed": True}),
    _ev("runner_on_failed", host="node2", task="Write limits", role="common",
        res={"msg": "Destination directory /etc/security/limits.d does not exist\nsecond line"}),
    _ev("runner_on_failed", host="node1", task="Probe GPUs", role="common", ignore_errors=True,
        res={"msg": "nvidia-smi: not found"}),
    _ev("runner_on_skipped", host="node1", task="Load nvidia-peermem", role="nvidia_driver"),
    _ev("runner_on_unreachable", host="node3", task="Gathering Facts",
        res={"msg": "Failed to connect to the host via ssh: No route to host"}),
    _ev("playbook_on_stats"),
]


def _progress() -> Progress:
    progress = Progress()
    lines = [progress.handle(e) for e in EVENTS]
    assert "node1        changed     common : Write limits" in lines
    assert "node2        failed      common : Write limits" in lines
    return progress


def test_counts_per_host() -> None:
    summary = _progress().summary()
    assert summary["plays"] == 2 and summary["tasks"] == 2
    assert summary["hosts"]["node1"] == {"ok": 2, "changed": 1, "failed": 0, "skipped": 1, "ignored": 1,
                                         "unreachable": False, "status": "done"}
    assert summary["hosts"]["node2"]["failed"] == 1 and summary["hosts"]["node2"]["status"] == "failed"
    assert summary["hosts"]["node3"]["status"] == "unreachable"


def test_failures_keep_host_task_and_message_but_not_ignored_errors() -> None:
    failures = _progress().failures
    assert [(f.host, f.task) for f in failures] == [("node2", "common : Write limits"),
                                                    ("node3", "Gathering Facts")]
    assert failures[0].message == "Destination directory /etc/security/limits.d does not exist\nsecond line"


def test_live_view_and_recap_render_as_text() -> None:
    progress = _progress()
    buf = io.StringIO()
    console = Console(file=buf, width=120, color_system=None)
    console.print(live_view(progress, started=0.0))
    render_recap(ProvisionResult(progress=progress, status="failed", rc=2, log_dir=Path("/tmp/x"),
                                 seconds=12.3), console)
    text = buf.getvalue()
    assert "play 2: Provision the nodes" in text
    assert "provision recap (failed, 12.3 s)" in text
    assert "FAILED node2: common : Write limits" in text and "  second line" in text
    assert "full log: /tmp/x/stdout.log" in text
