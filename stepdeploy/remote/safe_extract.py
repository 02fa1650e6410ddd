"""Unpack the archive a node sends back (`run fetch`): the node is not trusted, so neither is its archive.

tarfile's `extractall(filter="data")` is not used: on Python before 3.11.13/3.12.11 a chain of symbolic links
whose resolved path passes PATH_MAX escapes the filter (CVE-2025-4517), and a general extractor creates what an
archive asks for. Here tarfile only reads headers; we create every directory and file ourselves:

- only regular files are written; directories, symbolic and hard links, devices, FIFOs and sparse files are
  left out (and named in the answer); a directory a file needs is made by us;
- a name must be relative, normalized, without `..`, control characters or empty parts, at most MAX_DEPTH parts
  and MAX_NAME_CHARS long;
- every file is opened O_CREAT|O_EXCL|O_NOFOLLOW relative to its parent's descriptor (itself opened O_NOFOLLOW)
  inside a fresh private directory (mkdtemp, 0700) beside the destination, which is renamed into place only
  once the whole archive is unpacked: the destination holds the node's files or its previous ones, never half;
- a file over MAX_FILE_BYTES, an archive whose files add up to more than MAX_TOTAL_BYTES, more than MAX_MEMBERS
  entries or a header larger than MAX_HEADER_BYTES ends the unpacking with `FetchRefused`, whose message names
  the node, the file and the limit; the limits are module constants, and parameters of `extract` (`Limits`).
  Sizes are judged from each header, before its data is read; the decompressed stream stops a little past
  MAX_TOTAL_BYTES, so entries left out (a bad name, a link) cannot be used to send more.

What a node sends (`NodeExecutor.fetch`): out/metrics.jsonl (one line per iteration and restart, a few KiB each
with a MoE model's per-layer figures), out/phases.jsonl, out/status, out/heartbeat, out/*.json (profile and
memory-trace summaries, KiB) and logs/; never checkpoints. A metrics file or log near MAX_FILE_BYTES is a soak of
some 10^5 iterations; a node over a limit is the node's fault: `FetchRefused` is a StepdeployError of exit code
EXIT_FAILED (1), and the executor answers it as that node's failure, never as every node's.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import posixpath
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from stepdeploy.errors import EXIT_FAILED, StepdeployError

MiB = 1024 * 1024
MAX_FILE_BYTES = 512 * MiB  # one file (a chatty log of a long soak is the largest)
MAX_TOTAL_BYTES = 1024 * MiB  # all of one node's files
MAX_MEMBERS = 20_000  # entries of one archive (a node writes a few per rank)
MAX_HEADER_BYTES = MiB  # one pax or GNU long-name header
MAX_DEPTH = 16  # parts of one name
MAX_NAME_CHARS = 1024
CHUNK = 64 * 1024
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class FetchRefused(StepdeployError):
    """The node's archive breaks a limit or is not a gzip'd tar: nothing of it is kept (the node's fault)."""

    exit_code = EXIT_FAILED


@dataclass(frozen=True)
class Limits:
    file_bytes: int = MAX_FILE_BYTES
    total_bytes: int = MAX_TOTAL_BYTES
    members: int = MAX_MEMBERS
    header_bytes: int = MAX_HEADER_BYTES


@dataclass(frozen=True)
class Extracted:
    files: tuple[str, ...]  # written, relative to the destination
    left_out: tuple[str, ...]  # "NAME (why)" for every entry not written


def mib(size: int) -> str:
    """Bytes as MiB for a message: one decimal at most (3, 0.3, 1024)."""
    return f"{size / MiB:.1f}".rstrip("0").rstrip(".")


def _sizes(size: int, limit: int) -> tuple[str, str]:
    """A size and the limit it passes, in MiB, or in bytes where MiB would show them equal (a byte over)."""
    if mib(size) != mib(limit):
        return f"{mib(size)} MiB", f"{mib(limit)} MiB"
    return f"{size:,} bytes", f"{limit:,} bytes"


class _Capped(io.RawIOBase):
    """The decompressed stream, read by tarfile: no single read over `header_bytes` (tarfile reads a pax or
    long-name header whole) and no position past `end` (a gzip bomb stops there)."""

    def __init__(self, raw: IO[bytes], node: str, header_bytes: int, end: int) -> None:
        self.raw, self.node, self.header_bytes, self.end = raw, node, header_bytes, end

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > self.header_bytes:
            raise FetchRefused(f"node {self.node} sent an archive with a header or read of more than "
                               f"{mib(self.header_bytes)} MiB; refused")
        if self.raw.tell() + size > self.end:
            raise FetchRefused(f"node {self.node} sent an archive of more than {mib(self.end)} MiB unpacked; refused")
        return self.raw.read(size)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = self.raw.seek(offset, whence)
        if target > self.end:
            raise FetchRefused(f"node {self.node} sent an archive of more than {mib(self.end)} MiB unpacked; refused")
        return target

    def tell(self) -> int:
        return self.raw.tell()


def check_name(name: str) -> str:
    """The member name as a safe relative path; ValueError (why) otherwise."""
    if not name or len(name) > MAX_NAME_CHARS:
        raise ValueError("an empty or overlong name")
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or "\\" in name:
        raise ValueError("a name with control characters or backslashes")
    if name.startswith("/"):
        raise ValueError("an absolute name")
    parts = name.split("/")
    if ".." in parts:
        raise ValueError("a name with '..'")
    clean = posixpath.normpath(name)
    if clean in (".", "") or clean.startswith(("/", "..")):
        raise ValueError("a name outside the destination")
    if len(clean.split("/")) > MAX_DEPTH:
        raise ValueError(f"a name deeper than {MAX_DEPTH} parts")
    return clean


def _kind(member: tarfile.TarInfo) -> str | None:
    """Why a member is not a regular file we write (None: it is one)."""
    if member.issym():
        return "a symbolic link"
    if member.islnk():
        return "a hard link"
    if member.ischr() or member.isblk():
        return "a device"
    if member.isfifo():
        return "a FIFO"
    if member.isdir():
        return "a directory (made by us where a file needs one)"
    if member.issparse():
        return "a sparse file"
    if not member.isreg():
        return f"an entry of type {member.type!r}"
    return None


def _open_parent(root_fd: int, parts: list[str]) -> int:
    """A descriptor of the directory that holds the file, made as needed (0700), never through a link."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=fd)
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write(root_fd: int, name: str, source: IO[bytes], size: int, node: str) -> None:
    *dirs, base = name.split("/")
    parent = _open_parent(root_fd, dirs)
    try:
        fd = os.open(base, _FILE_FLAGS, 0o600, dir_fd=parent)
    finally:
        os.close(parent)
    written = 0
    with os.fdopen(fd, "wb") as handle:
        while written < size:
            chunk = source.read(min(CHUNK, size - written))
            if not chunk:
                break
            written += len(chunk)
            handle.write(chunk)
    if written != size:
        raise FetchRefused(f"node {node} sent a truncated archive ({name}: {written} of {size} bytes)")


def _unpack(archive: tarfile.TarFile, root_fd: int, node: str, limits: Limits) -> Extracted:
    files: list[str] = []
    left_out: list[str] = []
    total = 0
    for count, member in enumerate(iter(archive.next, None), 1):
        if count > limits.members:
            raise FetchRefused(f"node {node} sent more than {limits.members:,} entries; refused")
        if (why := _kind(member)) is not None:
            if not member.isdir():
                left_out.append(f"{member.name[:200]!r} ({why})")
            continue
        try:
            name = check_name(member.name)
        except ValueError as exc:
            left_out.append(f"{member.name[:200]!r} ({exc})")
            continue
        if member.size > limits.file_bytes:
            sent, limit = _sizes(member.size, limits.file_bytes)
            raise FetchRefused(f"node {node} sent {sent} for {name}, more than the limit of {limit} per file")
        total += member.size
        if total > limits.total_bytes:
            sent, limit = _sizes(total, limits.total_bytes)
            raise FetchRefused(f"node {node} sent {sent} in all by {name}, more than the limit of {limit} for one node")
        source = archive.extractfile(member)
        if source is None:
            left_out.append(f"{name!r} (no data)")
            continue
        try:
            _write(root_fd, name, source, member.size, node)
        except OSError as exc:  # a name given twice, or a file where a later name needs a directory
            left_out.append(f"{name!r} (cannot be written there: {exc.strerror or exc})")
            continue
        files.append(name)
    return Extracted(tuple(files), tuple(left_out))


def extract(data: bytes, dest: Path, node: str, limits: Limits = Limits()) -> Extracted:
    """Unpack the gzip'd tar `data` a node sent into `dest` (replaced whole: a fresh private directory beside it
    is filled, then renamed into place). FetchRefused (nothing written) when a limit is broken."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.fetch-", dir=dest.parent))  # 0700
    try:
        root_fd = os.open(staging, _DIR_FLAGS)
        try:
            capped = _Capped(gzip.GzipFile(fileobj=io.BytesIO(data)), node, limits.header_bytes,
                             limits.total_bytes + (limits.members + 4) * 3 * tarfile.BLOCKSIZE)
            with tarfile.open(fileobj=capped, mode="r:") as archive:  # type: ignore[call-overload]
                done = _unpack(archive, root_fd, node, limits)
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            raise FetchRefused(f"node {node} sent something that is not a gzip'd tar archive ({exc})") from None
        finally:
            os.close(root_fd)
        _replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return done


def _replace(staging: Path, dest: Path) -> None:
    """Rename `staging` to `dest`; a `dest` already there (an earlier fetch) is moved aside first, then removed."""
    if not dest.exists() and not dest.is_symlink():
        os.rename(staging, dest)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    os.rename(dest, old / "previous")
    os.rename(staging, dest)
    shutil.rmtree(old, ignore_errors=True)


__all__ = ["MAX_FILE_BYTES", "MAX_MEMBERS", "MAX_TOTAL_BYTES", "Extracted", "FetchRefused", "Limits", "check_name",
           "extract", "mib"]
