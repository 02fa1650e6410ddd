"""A copy of this rank's part of the newest committed checkpoint in the node's memory, which outlives the rank: a
restart on the same node reads it instead of the storage (issue 37 item 2). The committed checkpoint on storage
stays the source of truth: the copy is used only where it is provably the same files, and never after a reboot or
on another node (it is not there), when it is of another iteration (stale) or half-written.

Where: /dev/shm/stepdeploy-<uid>/<run id>/rank<R>/iter_<N>/, the first level made 0700 and checked to be this
user's own directory, not a link (a predictable name in a world-writable directory is otherwise anyone's). What:
the data files this rank wrote (`__<rank>_*.distcp`), copied from the committed checkpoint after its commit by a
thread, each under a temporary name then renamed, and last a marker, host-copy.json, naming the iteration and
each file's size and its storage copy's modification time. A restore uses a file of the copy only when the marker
is of the iteration it restores and the file's size equals the marker's and the storage file's, whose modification
time is still the marker's (a checkpoint saved again under the same number is new files).

The copy goes when the rank's training ends (Copier.discard); a run that ends in a failure it does not restart
from leaves its last copy in memory until the node reboots (or `rm -rf /dev/shm/stepdeploy-<uid>/<run id>`).

Skipped, and logged once: when the checkpoint directory is itself in memory (tmpfs: the storage is the host copy,
as on the GPU box), when the node lacks the memory (MemAvailable below the copy plus 10 % of the node), with
STEPDEPLOY_HOST_COPY=0. Standard library only (shipped as a file).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

from metrics import log

BASE = Path("/dev/shm")
MARKER = "host-copy.json"
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def memory_backed(path: Path, mounts: str | None = None) -> bool:
    """Whether `path` lies on a memory file system (the mount with the longest matching mount point)."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return False
    real, best, kind = os.path.realpath(path), -1, ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), fields[2]
    return kind in MEMORY_FILESYSTEMS


def private_dir(path: Path) -> bool:
    """`path` is a directory (not a link) of this user that no one else may enter or write."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077


def host_dir(run_id: str, rank: int, ckpt_dir: Path, base: Path = BASE) -> Path | None:
    """This rank's host copy directory (made if missing), or None with the reason logged: switched off, the
    checkpoints already in memory, no private place."""
    if os.environ.get("STEPDEPLOY_HOST_COPY", "1") == "0":
        log(rank, "host copy: off (STEPDEPLOY_HOST_COPY=0)")
        return None
    if memory_backed(ckpt_dir):
        log(rank, f"host copy: not kept, the checkpoints ({ckpt_dir}) are in memory already")
        return None
    top = base / f"stepdeploy-{os.geteuid()}"
    try:
        top.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        log(rank, f"host copy: not kept, {top} cannot be made: {exc}")
        return None
    if not private_dir(top):
        log(rank, f"host copy: not kept, {top} is not a private directory of this user")
        return None
    where = top / (_SAFE.sub("_", run_id) or "run") / f"rank{rank}"
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    return where


def _own_files(committed: Path, rank: int) -> list[Path]:
    return sorted(p for p in committed.glob(f"__{rank}_*.distcp") if p.is_file())


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _total_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Copier:
    """Makes the host copy of each committed checkpoint, one at a time, in a thread (copy(): start it)."""

    def __init__(self, where: Path | None, rank: int) -> None:
        self.where, self.rank = where, rank
        self.thread: threading.Thread | None = None

    def copy(self, committed: Path, iteration: int) -> None:
        """Copy this rank's files of the committed checkpoint `iteration` (once the copy before has ended)."""
        if self.where is None:
            return
        self.join()
        self.thread = threading.Thread(target=self._copy, args=(committed, iteration), name="host-copy", daemon=True)
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def discard(self) -> None:
        """The end of training: no restart will read the copy, so it gives the node its memory back."""
        if self.where is not None:
            self.join()
            shutil.rmtree(self.where, ignore_errors=True)

    def _copy(self, committed: Path, iteration: int) -> None:
        assert self.where is not None
        files = _own_files(committed, self.rank)
        size = sum(p.stat().st_size for p in files)
        available = _available_bytes()
        if available is not None and available - size < 0.1 * _total_bytes():
            log(self.rank, f"host copy of checkpoint {iteration} skipped: {size / 1e9:.1f} GB would leave less than "
                           f"10 % of the node's memory ({available / 1e9:.1f} GB available)")
            return
        target = self.where / f"iter_{iteration:07d}"
        try:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(mode=0o700)
            listed: dict[str, dict[str, int]] = {}
            for source in files:
                part = target / f".{source.name}.part"
                shutil.copyfile(source, part)
                os.replace(part, target / source.name)
                info = source.stat()
                listed[source.name] = {"size": info.st_size, "mtime_ns": info.st_mtime_ns}
            marker = target / f".{MARKER}.part"
            marker.write_text(json.dumps({"iteration": iteration, "files": listed}))
            os.replace(marker, target / MARKER)
        except OSError as exc:  # the storage copy went (retention) or the memory filled: no marker, never used
            log(self.rank, f"host copy of checkpoint {iteration} not made: {exc}")
            shutil.rmtree(target, ignore_errors=True)
            return
        for older in self.where.glob("iter_*"):
            if older != target:
                shutil.rmtree(older, ignore_errors=True)
        log(self.rank, f"host copy of checkpoint {iteration}: {len(files)} file(s), {size / 1e9:.2f} GB")


def usable(where: Path | None, committed: Path, iteration: int) -> tuple[dict[str, Path], str]:
    """{file name: its host copy} a restore of checkpoint `iteration` (on storage at `committed`) may read
    instead of the storage's, and what was found (for the log)."""
    if where is None:
        return {}, "no host copy kept"
    target = where / f"iter_{iteration:07d}"
    marker = _marker(target / MARKER)
    if marker is None:
        others = sorted(p.name for p in where.glob("iter_*"))
        return {}, (f"no complete host copy of checkpoint {iteration}" + (f" (found {', '.join(others)})"
                                                                          if others else ""))
    if marker.get("iteration") != iteration:
        return {}, f"the host copy's marker names checkpoint {marker.get('iteration')!r}, not {iteration}"
    found: dict[str, Path] = {}
    for name, listed in marker["files"].items():
        copy, source = target / name, committed / name
        try:
            copied, stored = copy.stat(), source.stat()
        except OSError:
            continue
        if copied.st_size == stored.st_size == listed["size"] and stored.st_mtime_ns == listed["mtime_ns"]:
            found[name] = copy
    left = len(marker["files"]) - len(found)
    return found, f"{len(found)} file(s) of checkpoint {iteration} in the host copy" + (
        f", {left} not the storage's (read from storage)" if left else "")


def _marker(path: Path) -> dict[str, Any] | None:
    """The marker, read through a bounded schema: anything else is no marker."""
    try:
        if path.stat().st_size > 1 << 20:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("iteration"), int):
        return None
    files = data.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and "/" not in name and not name.startswith(".") and isinstance(entry, dict)
            and isinstance(entry.get("size"), int) and isinstance(entry.get("mtime_ns"), int)
            for name, entry in files.items()):
        return None
    return data
