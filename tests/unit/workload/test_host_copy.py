"""host_copy.py: where the host copy lives (a private directory, never in a checkpoint directory already in memory),
what it copies (this rank's data files of a committed checkpoint, the marker last), and when a restore may use it:
only files of the iteration it restores, complete, and still the storage's -- a stale, half-written or re-saved copy
is never used. (The restore through it: megatron_cpu_checkpoint.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import host_copy
import pytest

MOUNTS = """/dev/vda / ext4 rw 0 0
tmpfs /dev/shm tmpfs rw 0 0
/dev/vdb /data xfs rw 0 0
tmpfs /data/fast tmpfs rw 0 0
"""


@pytest.mark.parametrize(("path", "memory"), [("/dev/shm/runs/x", True), ("/var/lib/stepdeploy", False),
                                              ("/data/ckpt", False), ("/data/fast/ckpt", True),
                                              ("/data/fastest", False)])
def test_memory_backed_follows_the_longest_mount_point(path: str, memory: bool) -> None:
    assert host_copy.memory_backed(Path(path), MOUNTS) is memory


def test_the_host_directory_is_private_and_none_where_it_should_not_be(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    disk = tmp_path / "ckpt"
    where = host_copy.host_dir("run/1 x", 3, disk, base=tmp_path)
    assert where == tmp_path / f"stepdeploy-{os.geteuid()}" / "run_1_x" / "rank3" and where.is_dir()
    assert host_copy.private_dir(where.parent.parent)
    # the checkpoints already in memory: the storage is the host copy
    assert host_copy.host_dir("r", 0, Path("/dev/shm/any"), base=tmp_path) is None
    monkeypatch.setenv("STEPDEPLOY_HOST_COPY", "0")
    assert host_copy.host_dir("r", 0, disk, base=tmp_path) is None


@pytest.mark.parametrize("planted", ["link", "open"])
def test_a_directory_someone_else_could_have_planted_is_not_used(tmp_path: Path, planted: str) -> None:
    top = tmp_path / f"stepdeploy-{os.geteuid()}"
    if planted == "link":
        (tmp_path / "elsewhere").mkdir()
        top.symlink_to(tmp_path / "elsewhere")
    else:
        top.mkdir(mode=0o777)
        top.chmod(0o777)
    assert host_copy.host_dir("r", 0, tmp_path / "ckpt", base=tmp_path) is None


def committed_checkpoint(root: Path, iteration: int) -> Path:
    committed = root / "checkpoints" / f"iter_{iteration:07d}"
    committed.mkdir(parents=True)
    for name, size in (("__0_0.distcp", 5000), ("__0_1.distcp", 7000), ("__1_0.distcp", 3000), (".metadata", 100)):
        (committed / name).write_bytes(os.urandom(size))
    return committed


def copied(tmp_path: Path, iteration: int = 40) -> tuple[Path, Path]:
    committed = committed_checkpoint(tmp_path, iteration)
    where = tmp_path / "host"
    where.mkdir()
    copier = host_copy.Copier(where, 0)
    copier.copy(committed, iteration)
    copier.join()
    return committed, where


def test_the_copy_holds_this_ranks_files_and_a_restore_of_that_iteration_reads_them(tmp_path: Path) -> None:
    committed, where = copied(tmp_path)
    target = where / "iter_0000040"
    assert sorted(p.name for p in target.iterdir()) == ["__0_0.distcp", "__0_1.distcp", "host-copy.json"]
    assert (target / "__0_1.distcp").read_bytes() == (committed / "__0_1.distcp").read_bytes()
    found, why = host_copy.usable(where, committed, 40)
    assert found == {"__0_0.distcp": target / "__0_0.distcp", "__0_1.distcp": target / "__0_1.distcp"}
    assert why == "2 file(s) of checkpoint 40 in the host copy"


def test_a_stale_copy_is_not_used(tmp_path: Path) -> None:
    committed, where = copied(tmp_path)
    newer = committed_checkpoint(tmp_path, 80)
    found, why = host_copy.usable(where, newer, 80)
    assert found == {} and why == "no complete host copy of checkpoint 80 (found iter_0000040)"
    # a marker that names another iteration than its directory's
    marker = where / "iter_0000040" / "host-copy.json"
    data = json.loads(marker.read_text())
    marker.write_text(json.dumps(data | {"iteration": 39}))
    assert host_copy.usable(where, committed, 40) == ({}, "the host copy's marker names checkpoint 39, not 40")


@pytest.mark.parametrize("damage", ["no marker", "garbage marker", "short file", "saved again"])
def test_a_half_written_or_changed_copy_is_not_used(tmp_path: Path, damage: str) -> None:
    committed, where = copied(tmp_path)
    target = where / "iter_0000040"
    if damage == "no marker":  # the copy was cut before its marker
        (target / "host-copy.json").unlink()
    elif damage == "garbage marker":
        (target / "host-copy.json").write_text('{"iteration": 40, "files": {"../../etc/passwd": {"size": 1}}}')
    elif damage == "short file":  # a file cut short: that one file comes from storage
        (target / "__0_1.distcp").write_bytes(b"x" * 10)
    else:  # the storage's file written again under the same number: new content, new modification time
        os.utime(committed / "__0_0.distcp", ns=(1, 1))
    found, why = host_copy.usable(where, committed, 40)
    if damage in ("no marker", "garbage marker"):
        assert found == {} and why.startswith("no complete host copy of checkpoint 40")
    else:
        assert len(found) == 1 and why.endswith("1 not the storage's (read from storage)")


def test_no_copy_where_memory_is_short_and_an_older_copy_goes_once_a_new_one_is_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    committed, where = copied(tmp_path)
    newer = committed_checkpoint(tmp_path, 80)
    copier = host_copy.Copier(where, 0)
    monkeypatch.setattr(host_copy, "_available_bytes", lambda: 1000)
    copier.copy(newer, 80)
    copier.join()
    assert "host copy of checkpoint 80 skipped" in capsys.readouterr().out
    assert sorted(p.name for p in where.iterdir()) == ["iter_0000040"]  # the last good one stays
    monkeypatch.setattr(host_copy, "_available_bytes", lambda: None)
    copier.copy(newer, 80)
    copier.join()
    assert sorted(p.name for p in where.iterdir()) == ["iter_0000080"]
    assert host_copy.usable(where, committed, 40)[0] == {}


def test_the_end_of_training_gives_the_memory_back(tmp_path: Path) -> None:
    _, where = copied(tmp_path)
    host_copy.Copier(where, 0).discard()
    assert not where.exists()
    host_copy.Copier(None, 0).discard()  # none kept: nothing to do
