"""remote/upload.py through the local executor (real shell commands on this machine): a run directory that holds
the same rendering is not uploaded again (a soak's restart), another rendering is refused, and a run directory
planted under a parent every user can write is never taken for ours."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from stepdeploy.remote import upload
from stepdeploy.remote.executor import Target
from stepdeploy.remote.local_executor import LocalExecutor
from stepdeploy.remote.transport import LocalChannel, session_environment


def prepare(run_dir: Path, local_run: Path, nodes: int = 1) -> list[tuple[bool, str]]:
    targets = [Target(f"n{i}", LocalChannel(f"n{i}", session_environment()), f"nodes/{i}-n{i}") for i in range(nodes)]
    return [(r.ok, r.detail) for r in LocalExecutor("r1", str(run_dir), targets).prepare(local_run)]


def rendered(tmp_path: Path, name: str, manifest: dict) -> Path:
    local_run = tmp_path / name
    local_run.mkdir()
    (local_run / "manifest.json").write_text(json.dumps(manifest))
    (local_run / "launch.sh").write_text("echo run\n")
    return local_run


def test_the_same_rendering_is_not_uploaded_again(tmp_path: Path) -> None:
    local_run = rendered(tmp_path, "rendered", {"run": "r1"})
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o755)
    assert prepare(runs / "r1", local_run) == [(True, "uploaded")]
    (local_run / "fetched").mkdir()  # what a soak's attempt fetched back lies in the local run directory
    (local_run / "fetched" / "rank0.log").write_text("x" * 1000)
    assert prepare(runs / "r1", local_run, nodes=2) == [(True, upload.THERE)] * 2
    assert not (runs / "r1" / "fetched").exists(), "the second prepare uploaded the directory again"
    assert sorted(p.name for p in runs.iterdir()) == ["r1"]  # no staging or tarball left beside it


def test_another_rendering_in_the_run_directory_is_refused(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o755)
    assert prepare(runs / "r1", rendered(tmp_path, "first", {"run": "r1", "n": 1}))[0][0]
    [(ok, detail)] = prepare(runs / "r1", rendered(tmp_path, "second", {"run": "r1", "n": 2}))
    assert not ok and "another rendering" in detail
    assert json.loads((runs / "r1" / "manifest.json").read_text()) == {"run": "r1", "n": 1}


def test_a_copy_of_our_manifest_under_a_shared_parent_is_not_ours(tmp_path: Path) -> None:
    local_run = rendered(tmp_path, "rendered", {"run": "r1"})
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    planted = shared / "r1"
    shutil.copytree(local_run, planted)  # anyone could have put it there, launch.sh of their own beside it
    (planted / "launch.sh").write_text("echo planted\n")
    [(ok, detail)] = prepare(planted, local_run)
    assert not ok and "writable by every user" in detail
    assert (planted / "launch.sh").read_text() == "echo planted\n"


def test_the_check_reads_a_missing_parent_as_not_there(tmp_path: Path) -> None:
    local_run = rendered(tmp_path, "rendered", {"run": "r1"})
    target = tmp_path / "absent" / "deeper" / "r1"
    assert prepare(target, local_run) == [(True, "uploaded")]
    assert (target / "launch.sh").read_text() == "echo run\n"
