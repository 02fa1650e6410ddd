"""The checkpoint protocol: complete or absent, `latest` moves only after the rename."""

from __future__ import annotations

from pathlib import Path

import ckpt  # tests/unit/workload/conftest.py puts the workload directory on sys.path


def test_latest_moves_only_after_commit(tmp_path: Path) -> None:
    assert ckpt.latest_iteration(tmp_path) is None
    staging = ckpt.staging_dir(tmp_path, 5)
    (staging / "state.pt").write_text("five")
    assert ckpt.latest_iteration(tmp_path) is None, "a staged checkpoint is not a checkpoint"
    ckpt.seal(staging, 5)
    assert ckpt.latest_iteration(tmp_path) is None, "a sealed but uncommitted checkpoint is not in place yet"
    final = ckpt.commit(tmp_path, 5)
    assert final == tmp_path / "iter_0000005" and (final / "state.pt").read_text() == "five"
    assert ckpt.latest_iteration(tmp_path) == 5
    assert not staging.exists()


def test_a_crash_while_writing_leaves_the_previous_checkpoint_current(tmp_path: Path) -> None:
    ckpt.seal(ckpt.staging_dir(tmp_path, 1), 1)
    ckpt.commit(tmp_path, 1)
    half = ckpt.staging_dir(tmp_path, 2)
    (half / "state.pt").write_text("half written")  # the process dies here: no commit
    assert ckpt.latest_iteration(tmp_path) == 1


def test_marker_naming_a_missing_checkpoint_means_fresh_start(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("7\n")
    assert ckpt.latest_iteration(tmp_path) is None
    (tmp_path / "latest").write_text("garbage")
    assert ckpt.latest_iteration(tmp_path) is None


def test_atomic_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    ckpt.atomic_write_json(tmp_path / "a" / "status.json", {"state": "running"})
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["status.json"]


def test_only_durable_writes_are_fsynced_and_both_replace_whole(tmp_path: Path, monkeypatch) -> None:
    synced: list[int] = []
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: synced.append(fd))
    target = tmp_path / "heartbeat.json"
    ckpt.atomic_write_json(target, {"iteration": 1}, durable=False)
    assert synced == [] and target.read_text() == '{"iteration": 1}\n'
    ckpt.atomic_write_json(target, {"iteration": 2})
    assert len(synced) == 1 and target.read_text() == '{"iteration": 2}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["heartbeat.json"]  # no temporary file left behind
