"""A dataset's files written whole or not at all, safely in a directory others may write to (such as /tmp).

The output directory is opened once, after refusing a symbolic link on its path that someone else planted in a
sticky world-writable directory (the rule of Linux's fs.protected_symlinks, which is often off); every later step
names files relative to that open directory, so swapping the path afterwards changes nothing. Each file goes to a
private temporary (a random name opened O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600: a name planted in advance is never
opened) and is hard-linked to its final name at the end, which fails if that name exists as anything (a file, a
directory, a planted symbolic link, dangling or not), so nothing is ever written through a link or over another
file; the linked name must then be the very file written (a temporary renamed away and replaced is caught). On any
failure every temporary, every final name linked so far and every directory made for the output is removed."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from stepdeploy import safeio
from stepdeploy.errors import BadInput

FILE_MODE = 0o644
DIR_MODE = 0o755
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_TEMP_TRIES = 16


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
    """`directory` and its missing parents made (0755) one at a time; returns those made, the deepest last. A name
    that appears in between as a directory is used (and not counted as made); as anything else it is refused."""
    missing: list[Path] = []
    current = directory
    while not existing(current):
        missing.append(current)
        current = current.parent
    made: list[Path] = []
    for path in reversed(missing):
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise BadInput(f"{path}: appeared while the output directory was made, and is not a directory; "
                               "refusing to write there", hint="give another --out prefix") from None
            continue
        except OSError as exc:
            raise BadInput(f"{path}: cannot make the output directory: {exc.strerror or exc}") from None
        made.append(path)
    if not directory.is_dir():
        raise BadInput(f"{directory}: not a directory; cannot write the output there")
    return made


def open_directory(directory: Path) -> int:
    """A descriptor of the output directory, reached through no symbolic link another user planted in a shared
    directory (checked again once it is open: the path must still lead to the directory opened)."""
    safeio.refuse_foreign_links(directory, "dataset")
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        raise BadInput(f"{directory}: cannot write the output there: {exc.strerror or exc}") from None
    try:
        safeio.refuse_foreign_links(directory, "dataset")
        opened, now = os.fstat(fd), os.stat(directory)
    except BaseException:
        os.close(fd)
        raise
    if (opened.st_dev, opened.st_ino) != (now.st_dev, now.st_ino):
        os.close(fd)
        raise BadInput(f"{directory}: changed while it was opened; refusing to write there")
    return fd


class Outputs:
    """The files of one output prefix, each a private temporary until `commit()` links them into place."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix
        self.temporaries: dict[str, tuple[str, BinaryIO]] = {}  # suffix -> (name in the directory, handle)
        self.linked: list[str] = []
        self.made: list[Path] = []
        self.dir_fd: int | None = None

    def final(self, suffix: str) -> Path:
        return Path(f"{self.prefix}{suffix}")

    def refuse_existing(self, suffixes: list[str]) -> None:
        for suffix in suffixes:
            if existing(self.final(suffix)):
                raise BadInput(f"{self.final(suffix)} exists; a dataset is never overwritten",
                               hint="give another --out prefix")

    def __enter__(self) -> Outputs:
        self.made = make_directories(self.prefix.parent)
        try:
            self.dir_fd = open_directory(self.prefix.parent)
        except BaseException:
            self._remove_made()
            raise
        return self

    def _directory(self) -> int:
        if self.dir_fd is None:
            raise RuntimeError("Outputs used outside its `with` block")
        return self.dir_fd

    def open(self, suffix: str) -> BinaryIO:
        """A new private temporary for `suffix`: a random name, created here and nowhere else."""
        for _ in range(_TEMP_TRIES):
            name = f".{self.prefix.name}{suffix}.{secrets.token_hex(8)}.tmp"
            try:
                fd = os.open(name, _TEMP_FLAGS, 0o600, dir_fd=self._directory())
            except FileExistsError:
                continue
            except OSError as exc:
                raise BadInput(f"{self.prefix.parent}: cannot write the output there: {exc.strerror or exc}"
                               ) from None
            handle = os.fdopen(fd, "wb")
            self.temporaries[suffix] = (name, handle)
            return handle
        raise BadInput(f"{self.prefix.parent}: {_TEMP_TRIES} random temporary names all taken; refusing to write there")

    def write(self, suffix: str, data: bytes) -> str:
        """A whole file's bytes; returns their sha256."""
        self.open(suffix).write(data)
        return hashlib.sha256(data).hexdigest()

    def commit(self, order: list[str]) -> None:
        """Every file to its final name, in `order` (the description last: its presence means the rest is whole)."""
        for suffix in order:
            name, handle = self.temporaries[suffix]
            handle.flush()
            os.fchmod(handle.fileno(), FILE_MODE)
            os.fsync(handle.fileno())
            written = os.fstat(handle.fileno())
            handle.close()
            final = self.final(suffix)
            self._place(name, final)
            self.linked.append(final.name)
            self._check_placed(final, written)
        self._remove_temporaries()
        self.linked, self.made = [], []

    def _place(self, temporary: str, final: Path) -> None:
        """link(2) refuses an existing name of any kind; a filesystem without hard links gets a rename after a
        check (rename replaces a name planted in between, never writes through it)."""
        fd = self._directory()
        try:
            os.link(temporary, final.name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            raise BadInput(f"{final} appeared while the dataset was written; a dataset is never overwritten",
                           hint="give another --out prefix") from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP) or self._exists(final.name):
                raise BadInput(f"{final}: cannot write it: {exc.strerror or exc}") from None
            os.rename(temporary, final.name, src_dir_fd=fd, dst_dir_fd=fd)

    def _check_placed(self, final: Path, written: os.stat_result) -> None:
        """The final name is the file written (not a link or file swapped in for the temporary's name)."""
        placed = os.stat(final.name, dir_fd=self._directory(), follow_symlinks=False)
        if (placed.st_dev, placed.st_ino) != (written.st_dev, written.st_ino):
            raise BadInput(f"{final}: its temporary was replaced while the dataset was written; refused",
                           hint="write the dataset in a directory only you can write to")

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self._directory(), follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def _remove_temporaries(self) -> None:
        for name, handle in self.temporaries.values():
            handle.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self._directory())
        self.temporaries.clear()

    def _remove_made(self) -> None:
        for directory in reversed(self.made):
            with contextlib.suppress(OSError):  # only an empty directory goes: one that holds others' files stays
                os.rmdir(directory)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.dir_fd is None:
            return
        try:
            self._remove_temporaries()
            for name in self.linked:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self.dir_fd)
        finally:
            os.close(self.dir_fd)
            self.dir_fd = None
            self._remove_made()
