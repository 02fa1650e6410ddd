"""The commit protocol under a kill at every point (issue 21): a child process writes, seals and commits a
checkpoint and is SIGKILLed just before its k-th file-system call (rename, fsync, unlink, rmdir, mkdir); repair()
then has to leave `latest` on a whole checkpoint -- the previous one or the new one, with its own content -- and
no temporary behind. Also: the re-save window, the completion marker, stale temporaries, retention."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import ckpt  # tests/unit/workload/conftest.py puts the workload directory on sys.path
import pytest

WORKLOAD = Path(ckpt.__file__).parent

# The child: count (and at call `kill_at` SIGKILL itself before) every file-system call that changes the store.
CHILD = r"""
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
import ckpt
from pathlib import Path

ckpt_dir, payload = Path(sys.argv[2]), sys.argv[4]
iteration, keep, kill_at, background = int(sys.argv[3]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1"
calls = [0]

def counted(fn):
    def call(*args, **kwargs):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return call

for name in ("replace", "rename", "fsync", "unlink", "rmdir", "mkdir"):
    setattr(os, name, counted(getattr(os, name)))
staging = ckpt.staging_dir(ckpt_dir, iteration, "tok")
(staging / "state.pt").write_text(payload)
ckpt.seal(staging, iteration)
remover = ckpt.Remover() if background else None  # the deletions in a thread of their own (as the engines)
ckpt.commit(ckpt_dir, iteration, staging, keep=keep, remove=remover)
if remover is not None:
    remover.drain()
print(json.dumps({"calls": calls[0]}))
"""


def save(ckpt_dir: Path, iteration: int, payload: str, keep: int | None = None) -> None:
    staging = ckpt.staging_dir(ckpt_dir, iteration)
    (staging / "state.pt").write_text(payload)
    ckpt.seal(staging, iteration)
    ckpt.commit(ckpt_dir, iteration, keep=keep)


def child(ckpt_dir: Path, iteration: int, payload: str, keep: int, kill_at: int,
          background: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(WORKLOAD), str(ckpt_dir), str(iteration), payload,
                           str(keep), str(kill_at), str(int(background))],
                          capture_output=True, text=True, timeout=60, check=False)


def content(ckpt_dir: Path, iteration: int) -> str:
    return (ckpt_dir / ckpt.iteration_name(iteration) / "state.pt").read_text()


# (what is committed before, the iteration the child commits, keep)
SCENARIOS = {
    "new iteration": ([10, 20], 30, 2),
    "re-save of the latest iteration": ([10, 20], 20, 2),
    "re-save of an older iteration": ([10, 20], 10, 3),
    "first checkpoint": ([], 10, 1),
}


@pytest.mark.parametrize("background", [False, True], ids=["deleted-at-once", "deleted-by-remover"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_kill_at_every_point_of_a_save_leaves_latest_on_a_whole_checkpoint(scenario: str, background: bool,
                                                                             tmp_path: Path) -> None:
    before, iteration, keep = SCENARIOS[scenario]
    dry = tmp_path / "dry"
    for i in before:
        save(dry, i, f"old {i}")
    done = child(dry, iteration, f"new {iteration}", keep, 0, background)
    assert done.returncode == 0, done.stderr
    total = json.loads(done.stdout)["calls"]
    assert total >= 10, total  # staging, files, marker, renames, latest, deletions
    previous = max(before) if before else None
    for kill_at in range(1, total + 1):
        ckpt_dir = tmp_path / f"k{kill_at}"
        for i in before:
            save(ckpt_dir, i, f"old {i}")
        proc = child(ckpt_dir, iteration, f"new {iteration}", keep, kill_at, background)
        assert proc.returncode == -9, (kill_at, proc.stderr)
        named = (ckpt_dir / "latest").read_text() if (ckpt_dir / "latest").exists() else None
        ckpt.repair(ckpt_dir)
        latest = ckpt.latest_iteration(ckpt_dir)
        where = f"killed before call {kill_at} of {total}"
        # committed only when `latest` named it before the kill (issue 36: a sealed staging directory, or an
        # iter_N renamed in before `latest` moved, was rolled forward and read by the resume)
        if latest == iteration and iteration not in before:
            assert named == f"{iteration}\n", where
        assert ckpt.committed_iterations(ckpt_dir) == ckpt.complete_iterations(ckpt_dir), where
        assert max(ckpt.committed_iterations(ckpt_dir), default=None) == latest, where
        # the previous checkpoint (or, re-saving an older one, the newest of before) or the new one, whole
        assert latest in {previous, iteration, max([*before, iteration])}, where
        if latest is not None:
            assert (ckpt_dir / "latest").read_text() == f"{latest}\n", where
            expected = {f"old {latest}"} | ({f"new {iteration}"} if latest == iteration else set())
            assert content(ckpt_dir, latest) in expected, where
        if latest != iteration and previous is not None:  # not committed: the previous one is there, whole
            assert latest == previous and content(ckpt_dir, previous) == f"old {previous}", where
        if latest is None:
            assert not (ckpt_dir / "latest").exists(), where
        leftovers = [p.name for p in ckpt_dir.iterdir() if p.name.startswith(".")] if ckpt_dir.exists() else []
        assert leftovers == [], (where, leftovers)
        assert ckpt.repair(ckpt_dir) == [], where  # a second repair finds nothing to do
        # and the run goes on: the next save commits and retention holds
        save(ckpt_dir, 40, "after", keep=keep)
        assert ckpt.latest_iteration(ckpt_dir) == 40 and len(ckpt.complete_iterations(ckpt_dir)) <= keep, where


def test_the_re_save_window(tmp_path: Path) -> None:
    """`latest` names 20 (one node got further than the others); the resume goes back and the node saves 20
    again. Killed while writing, and killed between moving the old 20 aside and moving the new one in, a complete
    20 stays reachable (before: commit deleted the old 20 first, then `latest` named a missing directory)."""
    save(tmp_path, 10, "old 10")
    save(tmp_path, 20, "old 20")
    half = ckpt.staging_dir(tmp_path, 20, "again")
    (half / "state.pt").write_text("new 20, half written")  # killed while writing: never sealed
    ckpt.repair(tmp_path)
    assert ckpt.latest_iteration(tmp_path) == 20 and content(tmp_path, 20) == "old 20"

    staged = ckpt.staging_dir(tmp_path, 20, "again")
    (staged / "state.pt").write_text("new 20")
    ckpt.seal(staged, 20)
    os.replace(tmp_path / "iter_0000020", tmp_path / ".iter_0000020.old-x")  # commit's first rename, then killed
    assert ckpt.latest_iteration(tmp_path) == 10  # even unrepaired, a reader never gets a missing directory
    ckpt.repair(tmp_path)  # the new 20 was sealed, never committed: discarded, the old one put back
    assert ckpt.latest_iteration(tmp_path) == 20 and content(tmp_path, 20) == "old 20"

    staged = ckpt.staging_dir(tmp_path, 20, "again")
    (staged / "state.pt").write_text("new 20")
    ckpt.seal(staged, 20)
    ckpt.commit(tmp_path, 20, staged)
    os.replace(tmp_path / "iter_0000020", tmp_path / ".iter_0000020.old-y")  # the aside alone: it goes back
    ckpt.repair(tmp_path)
    assert ckpt.latest_iteration(tmp_path) == 20 and content(tmp_path, 20) == "new 20"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000010", "iter_0000020", "latest"]


def test_a_sealed_checkpoint_is_never_rolled_forward_and_only_latest_commits(tmp_path: Path) -> None:
    """Issue 36: killed after the write, before the commit, every node restarted from its sealed staging
    directory while `latest` stayed behind. A checkpoint is committed when `latest` names it, nothing else."""
    save(tmp_path, 10, "ten")
    sealed = ckpt.staging_dir(tmp_path, 20, "tok")
    (sealed / "state.pt").write_text("twenty, sealed")
    ckpt.seal(sealed, 20)
    renamed = ckpt.staging_dir(tmp_path, 30, "tok")  # commit's rename done, `latest` not moved yet
    (renamed / "state.pt").write_text("thirty")
    ckpt.seal(renamed, 30)
    os.replace(renamed, tmp_path / "iter_0000030")
    assert ckpt.committed_iterations(tmp_path) == [10]  # even unrepaired, a resume never reads 30
    done = ckpt.repair(tmp_path)
    assert any("never committed" in d and ".iter_0000020.tmp-tok" in d for d in done), done
    assert any("iter_0000030" in d and "never committed" in d for d in done), done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000010", "latest"]
    assert ckpt.committed_iterations(tmp_path) == [10] == ckpt.complete_iterations(tmp_path)

    first = tmp_path / "first"  # a first checkpoint renamed in, `latest` never written: nothing is committed
    staged = ckpt.staging_dir(first, 10)
    ckpt.seal(staged, 10)
    os.replace(staged, first / "iter_0000010")
    assert ckpt.committed_iterations(first) == []
    ckpt.repair(first)
    assert list(first.iterdir()) == []


def test_discard_staging_removes_this_starts_staging_only_and_a_late_seal_cannot_bring_it_back(tmp_path: Path) -> None:
    save(tmp_path, 10, "ten")
    mine = ckpt.staging_dir(tmp_path, 20, "me")
    (mine / "state.pt").write_text("half")
    other = ckpt.staging_dir(tmp_path, 20, "other")  # another start's (a writer left over): repair's business
    done = ckpt.discard_staging(tmp_path, "me")
    assert done == ["removed .iter_0000020.tmp-me (its save was never committed)"], done
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "iter_0000010", "latest"]
    with pytest.raises(FileNotFoundError):  # the writer's seal after a stop discarded its directory
        ckpt.seal(mine, 20)
    assert not mine.exists()
    assert ckpt.discard_staging(tmp_path, "me") == []


def test_a_directory_without_its_marker_is_not_a_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, 10, "ten")
    legacy = tmp_path / "iter_0000020"
    legacy.mkdir()
    (legacy / "state.pt").write_text("no marker")
    (tmp_path / "latest").write_text("20\n")
    assert ckpt.latest_iteration(tmp_path) == 10
    assert ckpt.complete_iterations(tmp_path) == [10]
    (tmp_path / "iter_0000010" / "complete").write_text(json.dumps({"iteration": 11}))  # names another one
    assert ckpt.latest_iteration(tmp_path) is None
    staged = ckpt.staging_dir(tmp_path, 30)
    with pytest.raises(RuntimeError, match="not sealed"):
        ckpt.commit(tmp_path, 30, staged)


def test_repair_points_latest_at_the_newest_complete_checkpoint_and_removes_stale_temporaries(tmp_path: Path) -> None:
    save(tmp_path, 10, "ten")
    save(tmp_path, 20, "twenty")
    (tmp_path / "latest").write_text("30\n")  # names a missing directory
    ckpt.staging_dir(tmp_path, 30)  # unsealed, the old name without a token
    (ckpt.staging_dir(tmp_path, 40, "t") / "state.pt").write_text("unsealed")
    (tmp_path / ".latest.tmp-123").write_text("7\n")
    (tmp_path / ".iter_0000005.del-ab").mkdir()
    done = ckpt.repair(tmp_path)
    assert len(done) == 5, done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000010", "iter_0000020", "latest"]
    assert (tmp_path / "latest").read_text() == "20\n"
    for path in [tmp_path / "iter_0000020", tmp_path / "iter_0000010"]:
        ckpt._discard(path)
    assert ckpt.repair(tmp_path) and not (tmp_path / "latest").exists()
    assert ckpt.latest_iteration(tmp_path) is None
    assert ckpt.repair(tmp_path / "missing") == []


def test_retention_keeps_the_newest_k_up_to_the_committed_one(tmp_path: Path) -> None:
    for i in (10, 20, 30):
        save(tmp_path, i, str(i), keep=2)
    assert ckpt.complete_iterations(tmp_path) == [20, 30]
    save(tmp_path, 40, "40", keep=1)
    assert ckpt.complete_iterations(tmp_path) == [40]
    save(tmp_path, 50, "50")  # no keep: nothing removed
    save(tmp_path, 60, "60")
    assert ckpt.complete_iterations(tmp_path) == [40, 50, 60]
    # the run went back to 40 (another node had no 50): committing 45 drops the newer 50 and 60
    save(tmp_path, 45, "45", keep=2)
    assert ckpt.complete_iterations(tmp_path) == [40, 45]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000040", "iter_0000045", "latest"]
    with pytest.raises(ValueError):
        ckpt.prune(tmp_path, 0, 45)


def test_a_remover_deletes_after_commit_returns_and_drain_waits_for_it(tmp_path: Path) -> None:
    """Retention through a Remover: commit() returns with what goes already out of sight (renamed, so `latest`
    and the complete checkpoints are final) and before it is deleted; drain() waits for the deletion."""
    gate, handed = threading.Event(), []

    def slow_remove(path: Path) -> None:
        handed.append(path.name)
        gate.wait(10)
        ckpt._remove(path)

    remover = ckpt.Remover(slow_remove)
    for i in (10, 20):
        save(tmp_path, i, str(i))
    staging = ckpt.staging_dir(tmp_path, 30)
    (staging / "state.pt").write_text("30")
    ckpt.seal(staging, 30)
    ckpt.commit(tmp_path, 30, staging, keep=1, remove=remover)
    assert ckpt.latest_iteration(tmp_path) == 30 and ckpt.complete_iterations(tmp_path) == [30]
    hidden = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert len(hidden) == 2 and all(".del-" in name for name in hidden), hidden  # not deleted yet
    assert not remover.drain(timeout=0.2)  # a stop's bounded wait: still deleting
    gate.set()
    assert remover.drain(timeout=10)
    remover.drain()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000030", "latest"]
    assert sorted(handed) == hidden


def test_the_resume_takes_the_newest_iteration_every_node_has() -> None:
    assert ckpt.newest_common([[10, 20], [10]]) == 10  # the oldest `latest`, as before
    assert ckpt.newest_common([[20], [10]]) == 0  # nobody has a common one: a fresh start, never a missing one
    assert ckpt.newest_common([[10, 20], [10, 20, 30]]) == 20
    assert ckpt.newest_common([[], [10]]) == 0
    assert ckpt.newest_common([]) == 0
