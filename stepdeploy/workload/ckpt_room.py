"""Room on the checkpoint disk (standard library only; shipped as a file).

A save that meets a full disk used to end its rank unnamed: the exit record (out/status) and the log line that
would have said ENOSPC are written to the same full disk, so they failed too, and the controller saw a rank "died
without exiting" with the generic hint. Now:

    reserve  every writing rank holds RESERVE_BYTES on the checkpoint disk from its start (Reserve), given back
             when a save fails for room, so that the record and the log lines saying so can be written
    check    before a save writes, the disk must have room for one more checkpoint of the size of the newest one
             (check_room): a save that cannot fit fails before it fills the disk, naming path, free and needed
    name     a save that failed for room (ENOSPC, errno 28) ends the rank with DiskFull: the path, what
             is free, and the fix; the controller's diagnosis (monitor/diagnose.py, signature disk_full) reads
             "No space left on device" in the rank's log and exit reason and ends the soak with that line
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

RESERVE_BYTES = 1 << 20
NEARLY_FULL = 16 << 20  # a write that failed with less than this free failed for room
ROOM_MARGIN = 1.05  # a save needs the newest checkpoint's size and this much more (the metadata, a grown state)
FIX = ("free space on that disk (old runs, old checkpoints), keep fewer checkpoints (--keep-checkpoints), or give "
       "the run a larger checkpoint disk (--remote-dir)")


class DiskFull(OSError):
    """A save that does not fit the checkpoint disk (errno ENOSPC)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    @classmethod
    def of(cls, ckpt_dir: Path, iteration: int, needed: int = 0, cause: str = "") -> DiskFull:
        return cls(_detail(ckpt_dir, iteration, needed or None, cause))

    def __str__(self) -> str:
        return f"[Errno {errno.ENOSPC}] No space left on device: {self.strerror}"


def is_disk_full(exc: BaseException | None) -> bool:
    """ENOSPC (or EDQUOT) anywhere in the exception's chain, or in its text (megatron-core wraps a writer's
    error into a CheckpointException whose message quotes it)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "[Errno 28]" in text or "Disk quota exceeded" in text:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def mib(size: int | None) -> str:
    return "unknown" if size is None else f"{size / 2**20:,.1f} MiB"


def _detail(ckpt_dir: Path, iteration: int, needed: int | None, cause: str = "") -> str:
    """The checkpoint that did not fit, where, what is free (and needed), the fix: str(DiskFull) says "No space
    left on device" before it, which the controller's diagnosis recognizes."""
    need = f", the save needs about {mib(needed)}" if needed else ""
    why = f" ({cause})" if cause else ""
    return (f"checkpoint {iteration} in {ckpt_dir}: free {mib(free_bytes(ckpt_dir))}{need}{why}. Fix: {FIX}")


def check_room(ckpt_dir: Path, iteration: int, needed: int) -> None:
    """Raise DiskFull when the disk of ckpt_dir lacks `needed` bytes (x ROOM_MARGIN) for the next save; 0: no
    estimate yet (the first save), no check."""
    free = free_bytes(ckpt_dir)
    if needed <= 0 or free is None or free >= needed * ROOM_MARGIN:
        return
    raise DiskFull(_detail(ckpt_dir, iteration, needed))


class Reserve:
    """RESERVE_BYTES held in a file of ckpt_dir (written, fsync'd) from the start, so that when the disk fills the
    rank still has room to say so. release() gives it back (a failed save, the end of the process)."""

    def __init__(self, ckpt_dir: Path, rank: int) -> None:
        self.path: Path | None = ckpt_dir / f".room-r{rank}"
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as handle:
                handle.write(b"\0" * RESERVE_BYTES)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError:  # already full: nothing held, nothing to give back
            self.release()

    def release(self) -> bool:
        """-> whether it gave anything back"""
        path, self.path = self.path, None
        if path is None:
            return False
        try:
            path.unlink()
        except OSError:
            return False
        return True
