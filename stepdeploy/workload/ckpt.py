"""Checkpoint and small-file protocol shared by both engines (standard library only; shipped as a file).

A checkpoint directory `iter_NNNNNNN` is complete or it is not a checkpoint:

    write   into a staging directory `.iter_N.tmp-<token>` (the token: one per process start, so a writer left
            over from a killed start never writes into a later start's staging directory)
    seal    fsync every file, then write the completion marker `complete` (fsync'd) last, then fsync the directory
            -- only after every rank's part is written: the engine decides when (its all-ranks check)
    commit  rename an existing `iter_N` aside (a re-save of an iteration; never deleted first), rename the sealed
            staging directory into place, point `latest` at it (a temporary file renamed), then delete the old
            copy, then retention: the newest K complete checkpoints up to N stay (none newer than N: those belong
            to a timeline the run went back from). What goes is renamed out of sight first; the deletion itself
            may run in a thread of its own (Remover), off the training loop
    repair  on resume, before anything reads: a checkpoint is committed only when `latest` names it, so a
            sealed staging directory whose commit was cut short is discarded (never rolled forward: another node
            may not have sealed its part), and so is a complete iter_N newer than `latest` (its commit was cut
            between the rename and `latest`, or it belongs to a timeline the run went back from) and, with no
            `latest` at all, every iter_N; a re-save's aside copy is put back when the new one never arrived;
            everything else half-made (unsealed staging, asides, deletions, `.latest.tmp-*`) is removed. A
            `latest` that names no complete checkpoint (damaged) is made to name the newest complete one.
    discard a stop, a failure or the end of a run removes this start's staging directories (discard_staging):
            renamed out of sight first, so a writer still running cannot recreate or refill them.

`latest` only ever names a complete checkpoint; readers still verify the marker (latest_iteration), and take the
newest complete one when `latest` is wrong. A resume reads committed_iterations() only. Renames of whole
directories and the marker make every step atomic: a kill at any instant leaves the previous checkpoint or the new
one, both whole.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

LATEST = "latest"
COMPLETE = "complete"  # the completion marker, written last inside a checkpoint directory
_FINAL = re.compile(r"iter_(\d{7,})")
_STAGED = re.compile(r"\.iter_(\d{7,})\.tmp(?:-.*)?")
_ASIDE = re.compile(r"\.iter_(\d{7,})\.old-.*")  # a committed copy moved aside by a re-save of its iteration
_DOOMED = re.compile(r"\.iter_(\d{7,})\.del-.*|\.latest\.tmp-.*")


def atomic_write_text(path: Path, text: str, durable: bool = True, parents: bool = True) -> None:
    """Readers see the old text or the new, never a part. durable=False skips the fsync: for a file rewritten
    every step (the heartbeat), where what matters is that the reader sees a whole file, not a power loss.
    parents=False: a missing directory is an error (FileNotFoundError), not made."""
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, data: Any, durable: bool = True, parents: bool = True) -> None:
    atomic_write_text(path, json.dumps(data, sort_keys=True) + "\n", durable, parents)


def iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def new_token() -> str:
    """A staging-directory token for this process start."""
    return f"{int(time.time())}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def is_complete(path: Path, iteration: int) -> bool:
    """`path` holds checkpoint `iteration` whole: its marker is there and names that iteration."""
    try:
        marker = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("iteration") == iteration


def complete_iterations(ckpt_dir: Path) -> list[int]:
    """The iterations of every complete checkpoint in ckpt_dir, oldest first."""
    found = []
    for path in _entries(ckpt_dir):
        match = _FINAL.fullmatch(path.name)
        if match and is_complete(path, int(match.group(1))):
            found.append(int(match.group(1)))
    return sorted(found)


def latest_iteration(ckpt_dir: Path) -> int | None:
    """The iteration `latest` names when that checkpoint is complete, else the newest complete one; None: a fresh
    start (no complete checkpoint)."""
    try:
        named = int((ckpt_dir / LATEST).read_text().strip())
    except (OSError, ValueError):
        named = None
    if named is not None and is_complete(ckpt_dir / iteration_name(named), named):
        return named
    complete = complete_iterations(ckpt_dir)
    return complete[-1] if complete else None


def staging_dir(ckpt_dir: Path, iteration: int, token: str = "") -> Path:
    """An empty directory to write checkpoint `iteration` into before seal() and commit()."""
    tmp = staging_path(ckpt_dir, iteration, token)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def staging_path(ckpt_dir: Path, iteration: int, token: str = "") -> Path:
    return ckpt_dir / f".{iteration_name(iteration)}.tmp{'-' + token if token else ''}"


def seal(staging: Path, iteration: int) -> None:
    """Make the staged checkpoint durable, then mark it complete (the marker last, then the directory entry)."""
    _fsync_tree(staging)
    # parents=False: a staging directory discarded meanwhile (a stop) must stay gone, not come back holding the
    # marker alone
    atomic_write_json(staging / COMPLETE, {"iteration": iteration, "sealed": time.time()}, parents=False)
    _fsync_dir(staging)


def _remove(path: Path) -> None:
    """Delete a directory (or file), its completion marker first: a deletion cut short is never complete."""
    if path.is_dir():
        (path / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def commit(ckpt_dir: Path, iteration: int, staging: Path | None = None, keep: int | None = None,
           remove: Callable[[Path], None] | None = None) -> Path:
    """Put the sealed checkpoint in `staging` in place as iter_N and point `latest` at it; then drop the copy it
    replaced and, with `keep`, all but the newest `keep` complete checkpoints up to N. `remove` deletes what is
    dropped, once out of sight (None: at once; a Remover: in its thread)."""
    remove = remove or _remove
    staging = staging or staging_path(ckpt_dir, iteration)
    if not is_complete(staging, iteration):
        raise RuntimeError(f"{staging}: not sealed, refusing to commit checkpoint {iteration}")
    final = ckpt_dir / iteration_name(iteration)
    aside = None
    if final.exists():  # a re-save: the old copy stays whole until the new one is in place
        aside = ckpt_dir / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, aside)
    os.replace(staging, final)
    _fsync_dir(ckpt_dir)
    atomic_write_text(ckpt_dir / LATEST, f"{iteration}\n")
    _fsync_dir(ckpt_dir)
    if aside is not None:
        remove(aside)
    if keep is not None:
        prune(ckpt_dir, keep, iteration, remove)
    return final


def prune(ckpt_dir: Path, keep: int, committed: int, remove: Callable[[Path], None] = _remove) -> list[int]:
    """Retention after committing `committed`: the newest `keep` complete checkpoints up to it stay; older ones
    and any newer one (left from before the run went back to an older checkpoint) go. Returns those removed."""
    if keep < 1:
        raise ValueError(f"keep {keep}: at least the committed checkpoint must stay")
    complete = complete_iterations(ckpt_dir)
    kept = [i for i in complete if i <= committed][-keep:]
    doomed = [i for i in complete if i not in kept]
    for iteration in doomed:
        _discard(ckpt_dir / iteration_name(iteration), remove)
    return doomed


def repair(ckpt_dir: Path) -> list[str]:
    """Before a resume reads ckpt_dir (one process per directory): undo what a kill cut short, remove stale
    temporaries and every checkpoint `latest` does not commit. Returns what it did (for the log)."""
    if not ckpt_dir.is_dir():
        return []
    done: list[str] = []
    for path in _entries(ckpt_dir):
        if _STAGED.fullmatch(path.name):  # sealed or not: its commit never happened
            _remove(path)
            done.append(f"removed {path.name} (its save was never committed)")
    done += _put_in_place(ckpt_dir, _ASIDE, "put {name} back as {final}")
    for path in _entries(ckpt_dir):
        if _DOOMED.fullmatch(path.name):
            _remove(path)
            done.append(f"removed {path.name}")
    done += _repair_latest(ckpt_dir)
    if done:
        _fsync_dir(ckpt_dir)
    return done


def committed_iterations(ckpt_dir: Path) -> list[int]:
    """The iterations a resume may read, oldest first: the complete checkpoints up to the one `latest` names (none
    without `latest`: a first checkpoint whose commit was cut short; every complete one when `latest` is damaged,
    as repair() then leaves it)."""
    complete = complete_iterations(ckpt_dir)
    named = _named(ckpt_dir)
    if named == _MISSING:
        return []
    if named is not None and named in complete:
        return [i for i in complete if i <= named]
    return complete


def discard_staging(ckpt_dir: Path, token: str) -> list[str]:
    """A stop, a failure or the end of a run: remove this start's staging directories (their saves were never
    committed), each renamed out of sight first (a writer still running then cannot refill it). -> the log lines"""
    done = []
    for path in _entries(ckpt_dir):
        if _STAGED.fullmatch(path.name) and path.name.endswith(f".tmp-{token}"):
            try:
                _discard(path)
            except OSError as exc:  # the next start's repair() removes what is left
                done.append(f"could not remove {path.name}: {exc}")
                continue
            done.append(f"removed {path.name} (its save was never committed)")
    return done


def _put_in_place(ckpt_dir: Path, pattern: re.Pattern[str], verb: str) -> list[str]:
    """Each copy of an iteration `pattern` names (group 1: the iteration) replaces a final directory that is not
    complete when the copy is; otherwise the copy is removed. -> what was done"""
    done: list[str] = []
    for path in _entries(ckpt_dir):
        match = pattern.fullmatch(path.name)
        if not match:
            continue
        iteration = int(match.group(1))
        final = ckpt_dir / iteration_name(iteration)
        if is_complete(path, iteration) and not is_complete(final, iteration):
            if final.exists():
                _discard(final)
            os.replace(path, final)
            done.append(verb.format(name=path.name, final=final.name))
        else:
            _remove(path)
            done.append(f"removed {path.name}")
    return done

_MISSING = -1  # _named(): no `latest` file at all


def _named(ckpt_dir: Path) -> int | None:
    """The iteration `latest` names; _MISSING without the file; None when it cannot be read as one."""
    try:
        return int((ckpt_dir / LATEST).read_text().strip())
    except FileNotFoundError:
        return _MISSING
    except (OSError, ValueError):
        return None


def _repair_latest(ckpt_dir: Path) -> list[str]:
    named = _named(ckpt_dir)
    complete = complete_iterations(ckpt_dir)
    if named is not None and (named == _MISSING or named in complete):
        # committed: up to what `latest` names (nothing without it); a newer one never was, or is of a timeline
        # the run went back from
        done = []
        for iteration in [i for i in complete if named == _MISSING or i > named]:
            _discard(ckpt_dir / iteration_name(iteration))
            done.append(f"removed {iteration_name(iteration)} (newer than `latest`"
                        f"{'' if named == _MISSING else f' {named}'}: never committed)")
        return done
    if complete:  # `latest` damaged: the newest complete checkpoint
        atomic_write_text(ckpt_dir / LATEST, f"{complete[-1]}\n")
        return [f"latest named {named}, now {complete[-1]} (the newest complete checkpoint)"]
    if (ckpt_dir / LATEST).exists():
        (ckpt_dir / LATEST).unlink()
        return [f"latest named {named}, removed (no complete checkpoint)"]
    return []


def newest_common(iterations_per_rank: list[list[int]]) -> int:
    """The newest iteration every rank has complete (0: none, a fresh start). Nodes' stores differ by at most the
    save in flight when they were stopped; with each node's `latest` alone, the oldest of them (what this
    replaces) names the same iteration whenever every node still holds it."""
    common = set(iterations_per_rank[0]) if iterations_per_rank else set()
    for iterations in iterations_per_rank[1:]:
        common &= set(iterations)
    return max(common, default=0)


def _entries(ckpt_dir: Path) -> list[Path]:
    try:
        return sorted(ckpt_dir.iterdir())
    except FileNotFoundError:
        return []


def _discard(path: Path, remove: Callable[[Path], None] = _remove) -> None:
    """Take a checkpoint directory out of sight in one rename, then delete it (a kill midway leaves a `.del-`
    directory that repair removes, never a half-deleted iter_N)."""
    doomed = path.with_name(f".{path.name}.del-{uuid.uuid4().hex[:8]}")
    os.replace(path, doomed)
    remove(doomed)


REMOVER_EXIT_WAIT_S = 10.0  # a stop waits this long at most for the deletions in hand


class Remover:
    """Deletes, in a thread of its own, what commit() and prune() have already taken out of sight (renamed to
    `.iter_N.del-*` / `.iter_N.old-*`), so retention does not stall the training loop: deleting a 9.6 GiB
    checkpoint took 0.6-1.2 s of every commit on the H200's tmpfs (docs/benchmarks.md). A process that ends
    midway leaves a renamed directory, which repair() removes at the next start; drain() waits for the rest."""

    def __init__(self, remove: Callable[[Path], None] = _remove) -> None:
        self._paths: queue.Queue[Path] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._remove_one = remove

    def __call__(self, path: Path) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-remover", daemon=True)
            self._thread.start()
        self._paths.put(path)

    def _run(self) -> None:
        while True:
            path = self._paths.get()
            try:
                self._remove_one(path)
            finally:
                self._paths.task_done()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything handed over is deleted (the end of a run: nothing left behind), at most `timeout`
        seconds (a stop: what is left, repair removes). -> whether everything is deleted"""
        if timeout is None:
            self._paths.join()
            return True
        deadline = time.monotonic() + timeout
        while self._paths.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._paths.unfinished_tasks


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for path in [p for p in root.rglob("*") if p.is_dir()]:
        _fsync_dir(path)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
