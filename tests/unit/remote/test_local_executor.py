"""The local executor's upload on this machine: the remote parent is judged by the directory it names, so a
runs directory that is a link to private storage (/var/lib/stepdeploy/runs -> /dev/shm/..., as bench/gpu_node.sh
sets up a GPU box) is accepted and one that leads to a directory every user can write is refused."""

from __future__ import annotations

from pathlib import Path

from stepdeploy.remote.executor import Target
from stepdeploy.remote.local_executor import LocalExecutor
from stepdeploy.remote.transport import LocalChannel, session_environment


def upload(run_dir: Path, local_run: Path) -> tuple[bool, str]:
    executor = LocalExecutor("r1", str(run_dir), [Target("n1", LocalChannel("n1", session_environment()),
                                                         "nodes/0-n1")])
    [result] = executor.prepare(local_run)
    return result.ok, result.detail


def test_a_runs_directory_linked_to_private_storage_is_accepted_to_shared_storage_refused(tmp_path: Path) -> None:
    local_run = tmp_path / "rendered"
    local_run.mkdir()
    (local_run / "manifest.json").write_text("{}")
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o755)
    shared.mkdir()
    shared.chmod(0o1777)
    (tmp_path / "runs").symlink_to(private)
    (tmp_path / "open-runs").symlink_to(shared)
    ok, detail = upload(tmp_path / "runs" / "r1", local_run)
    assert ok, detail
    assert (private / "r1" / "manifest.json").read_text() == "{}"
    ok, detail = upload(tmp_path / "open-runs" / "r1", local_run)
    assert not ok and "writable by every user" in detail
    assert list(shared.iterdir()) == []
