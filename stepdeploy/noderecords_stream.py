"""A node's JSON-lines file (metrics.jsonl, phases.jsonl) read incrementally: each read goes on from where the last
one stopped, so a soak that reads its fetched metrics on every collection (and its goodput, gates and live view
again) parses each line once, not once per read (issue 36 item 3).

A `FileCursor` keeps the records of the complete lines it has read (each ending with a newline), the byte offset
after them, and a fingerprint of the file: its first and its last bytes before that offset (up to FINGERPRINT
bytes each). A fetch replaces the fetched directory whole, so the file's inode changes on every fetch and says
nothing; its bytes do: when the file shrank, or the bytes at the fingerprint's places differ (a rotated,
truncated or rewritten file), it is read again from its start. A last line without its newline (cut by a kill,
or still being written) is read like the others but not kept: the next read parses it again, whole by then.

The rules of noderecords.py hold for every line (the same `loads` and the same parse): only a regular file is
opened (no FIFO, no link), a line over MAX_LINE_BYTES is counted bad and skipped unread, text that is not UTF-8
is read with replacement characters and a warning. Bad lines and warnings go to the caller's `Tally` when they
are first read: a read that finds nothing new notes nothing.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from stepdeploy.noderecords import MAX_LINE_BYTES, BadRecord, Tally, loads

FINGERPRINT = 4096  # bytes at the start of the file and before the offset that must read the same
CHUNK = 1 << 20  # bytes read at a time


@dataclass
class _Tail:
    """The last line of the previous read that had no newline: where it was and what it gave."""

    start: int
    raw: bytes  # the line as read (empty for one too long to hold)
    end: int
    records: list[Any]


@dataclass
class FileCursor:
    """The valid records of one growing JSON-lines file, read from where the previous read stopped."""

    path: Path
    source: str  # how the tally names the file
    parse: Callable[[Any], Any]
    allow_nan: bool = False
    records: list[Any] = field(default_factory=list)
    offset: int = 0  # bytes of complete lines read
    lines: int = 0  # complete lines read (blank ones included: tally notes count lines as a text editor does)
    head: bytes = b""
    mark: bytes = b""  # the bytes just before `offset`
    seen: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) at the last read
    tail: _Tail | None = None
    reads: int = field(default=0, compare=False)  # bytes read from the file in all (the tests count them)

    def read(self, tally: Tally) -> list[Any]:
        """Every valid record of the file as it is now (a fresh list; the records are shared: never change one)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self._reset()
            tally.note(self.source, f"cannot open it: {exc.strerror or exc}")
            return []
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                self._reset()
                tally.note(self.source, "not a regular file")
                return []
            key = (info.st_ino, info.st_size, info.st_mtime_ns)
            if key != self.seen:
                if not self._same(handle, info.st_size):
                    self._reset()
                self._advance(handle, tally)
                self.seen = key
        return [*self.records, *(self.tail.records if self.tail else ())]

    def _reset(self) -> None:
        self.records, self.offset, self.lines, self.head, self.mark = [], 0, 0, b"", b""
        self.seen, self.tail = None, None

    def _same(self, handle: IO[bytes], size: int) -> bool:
        """Whether the file still begins with what was read (its first bytes and those before the offset)."""
        if self.offset == 0:
            return True
        if size < self.offset:
            return False
        handle.seek(0)
        if handle.read(len(self.head)) != self.head:
            return False
        handle.seek(self.offset - len(self.mark))
        return handle.read(len(self.mark)) == self.mark

    def _advance(self, handle: IO[bytes], tally: Tally) -> None:
        """Read on from the offset: complete lines are kept, the last one without its newline is the tail."""
        handle.seek(self.offset)
        pos = line_start = self.offset  # bytes consumed; where the line being read began
        pending, long, replaced = b"", False, False  # long: the line being read is over MAX_LINE_BYTES (dropped)
        while chunk := handle.read(CHUNK):
            self.reads += len(chunk)
            data_at, data = pos - len(pending), pending + chunk
            pos += len(chunk)
            at = 0
            while (newline := data.find(b"\n", at)) >= 0:
                line, at = data[at:newline], newline + 1
                self.lines += 1
                if long or len(line) > MAX_LINE_BYTES:
                    tally.note(self.source, f"line {self.lines}: longer than {MAX_LINE_BYTES // 1024} KiB")
                    long = False
                else:
                    replaced |= self._line(line, self.lines, self.records, tally)
                line_start = data_at + at
            rest = data[at:]
            long = long or len(rest) > MAX_LINE_BYTES  # never held whole: counted when its newline comes
            pending = b"" if long else rest
        self.offset = line_start
        self._keep_fingerprint(handle)
        if replaced:
            tally.warn(f"{self.source}: not UTF-8; read with replacement characters")
        self._read_tail(pending, long, pos, tally)

    def _read_tail(self, pending: bytes, long: bool, end: int, tally: Tally) -> None:
        """The last line without its newline: parsed (once per change), not kept past the next read."""
        if end <= self.offset:
            self.tail = None
            return
        if self.tail is not None and (self.tail.start, self.tail.raw, self.tail.end) == (self.offset, pending, end):
            return  # the same cut line as last time: its records (and its note) stand
        records: list[Any] = []
        if long:
            tally.note(self.source, f"line {self.lines + 1}: longer than {MAX_LINE_BYTES // 1024} KiB")
        elif self._line(pending, self.lines + 1, records, tally):
            tally.warn(f"{self.source}: not UTF-8; read with replacement characters")
        self.tail = _Tail(self.offset, pending, end, records)

    def _line(self, raw: bytes, number: int, into: list[Any], tally: Tally) -> bool:
        """Parse one line into `into` (or note it bad); whether it needed replacement characters."""
        try:
            text, replaced = raw.decode("utf-8"), False
        except UnicodeDecodeError:
            text, replaced = raw.decode("utf-8", "replace"), True
        if text.strip():
            try:
                into.append(self.parse(loads(text, allow_nan=self.allow_nan)))
            except BadRecord as exc:
                tally.note(self.source, f"line {number}: {exc}")
        return replaced

    def _keep_fingerprint(self, handle: IO[bytes]) -> None:
        if self.offset == 0:
            self.head = self.mark = b""
            return
        handle.seek(0)
        self.head = handle.read(min(FINGERPRINT, self.offset))
        handle.seek(self.offset - min(FINGERPRINT, self.offset))
        self.mark = handle.read(min(FINGERPRINT, self.offset))


__all__ = ["FINGERPRINT", "FileCursor"]
