"""A dataset's files written whole or not at all, safely in a directory others may write to: each goes to a
private temporary (tempfile.mkstemp: an unpredictable name opened O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600) and is
hard-linked to its final name at the end, which fails if that name exists as anything (a file, a directory, a
planted symbolic link, dangling or not), so nothing is ever written through a link or over another file. On any
failure every temporary, every final name linked so far and every directory made for the output is removed."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from stepdeploy.errors import BadInput

FILE_MODE = 0o644
DIR_MODE = 0o755


class HashingFile:
    """Writes to a file and hashes what it wrote (the dataset's sha256, without opening the file again)."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.digest = handle, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.handle.write(data)

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def existing(path: Path) -> bool:
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise BadInput(f"{path}: cannot check the output: {exc.strerror or exc}") from None
    return True


def make_directories(directory: Path) -> list[Path]:
    """`directory` and its missing parents made (0755); returns those made, the deepest last."""
    missing: list[Path] = []
    current = directory
    while not existing(current):
        missing.append(current)
        current = current.parent
    try:
        os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"{directory}: cannot make the output directory: {exc.strerror or exc}") from None
    if not directory.is_dir():
        raise BadInput(f"{directory}: not a directory; cannot write the output there")
    return missing[::-1]


class Outputs:
    """The files of one output prefix, each a private temporary until `commit()` links them into place."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix
        self.temporaries: dict[str, tuple[Path, BinaryIO]] = {}
        self.linked: list[Path] = []
        self.made: list[Path] = []

    def final(self, suffix: str) -> Path:
        return Path(f"{self.prefix}{suffix}")

    def refuse_existing(self, suffixes: list[str]) -> None:
        for suffix in suffixes:
            if existing(self.final(suffix)):
                raise BadInput(f"{self.final(suffix)} exists; a dataset is never overwritten",
                               hint="give another --out prefix")

    def __enter__(self) -> Outputs:
        self.made = make_directories(self.prefix.parent)
        return self

    def open(self, suffix: str) -> BinaryIO:
        try:
            fd, name = tempfile.mkstemp(prefix=f".{self.prefix.name}{suffix}.", suffix=".tmp",
                                        dir=self.prefix.parent)
        except OSError as exc:
            raise BadInput(f"{self.prefix.parent}: cannot write the output there: {exc.strerror or exc}") from None
        handle = os.fdopen(fd, "wb")
        self.temporaries[suffix] = (Path(name), handle)
        return handle

    def write(self, suffix: str, data: bytes) -> str:
        """A whole file's bytes; returns their sha256."""
        self.open(suffix).write(data)
        return hashlib.sha256(data).hexdigest()

    def commit(self, order: list[str]) -> None:
        """Every file to its final name, in `order` (the description last: its presence means the rest is whole)."""
        for suffix in order:
            path, handle = self.temporaries[suffix]
            handle.flush()
            os.fchmod(handle.fileno(), FILE_MODE)
            os.fsync(handle.fileno())
            handle.close()
            self._place(path, self.final(suffix))
            self.linked.append(self.final(suffix))
        self._remove_temporaries()
        self.linked, self.made = [], []

    @staticmethod
    def _place(temporary: Path, final: Path) -> None:
        """link(2) refuses an existing name of any kind; a filesystem without hard links gets a rename after a
        check (the one case where a name planted in between could be replaced)."""
        try:
            os.link(temporary, final, follow_symlinks=False)
        except FileExistsError:
            raise BadInput(f"{final} appeared while the dataset was written; a dataset is never overwritten",
                           hint="give another --out prefix") from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP) or existing(final):
                raise BadInput(f"{final}: cannot write it: {exc.strerror or exc}") from None
            os.rename(temporary, final)

    def _remove_temporaries(self) -> None:
        for path, handle in self.temporaries.values():
            handle.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.temporaries.clear()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._remove_temporaries()
        for path in self.linked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for directory in reversed(self.made):
            with contextlib.suppress(OSError):  # only an empty directory goes: one that holds others' files stays
                os.rmdir(directory)
