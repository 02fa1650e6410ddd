"""A prepared dataset read back for `render --data` and `rollout run --data`: PREFIX.json checked, and the .bin
and .idx hashed against it. Every file is opened without following a symbolic link and without blocking, and
must be a regular file (a FIFO planted as PREFIX.json is refused, never waited on)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from stepdeploy import safeio
from stepdeploy.corpus.description import Corpus, parse
from stepdeploy.errors import BadInput

MAX_SHIPPED_BYTES = 256 * 2**20  # a dataset travels inside the run directory: keep it small
MAX_DESCRIPTION_BYTES = 2**20
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


def open_regular(path: Path, what: str, hint: str | None = None) -> int:
    """A descriptor of `path`, which must be a regular file and not a symbolic link; BadInput otherwise."""
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        raise BadInput(f"{path}: no such {what}", hint=hint) from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(before.st_mode):
        raise BadInput(f"{path}: a symbolic link; refusing to follow it to the {what}",
                       hint="give the dataset's own files (prepare it again where it should be)")
    if not stat.S_ISREG(before.st_mode):
        raise BadInput(f"{path}: not a regular file; refusing to read it as the {what}")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise BadInput(f"{path}: cannot read the {what}: {why}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the check and the open
        os.close(fd)
        raise BadInput(f"{path}: not a regular file; refusing to read it as the {what}")
    return fd


def read_checked(path: Path, what: str, sha256: str | None, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, whose sha256 must be `sha256` (unless None)."""
    hint = f"stepdeploy data prepare FILES --out {path.with_suffix('')}"
    with os.fdopen(open_regular(path, what, hint), "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise BadInput(f"{path}: {size / 2**20:.0f} MiB; a dataset travels inside the run directory, at most "
                           f"{limit // 2**20} MiB")
        try:
            data = handle.read(limit + 1)
        except OSError as exc:
            raise BadInput(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise BadInput(f"{path}: more than {limit // 2**20} MiB; refused")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise BadInput(f"{path}: does not match its description (changed since it was prepared)",
                       hint="prepare the dataset again: stepdeploy data prepare FILES --out PREFIX")
    return data


def load_prepared(prefix: Path) -> Corpus:
    """A prepared dataset, checked: PREFIX.json describes it, and its .bin and .idx hash to what it says."""
    meta = Path(f"{prefix}.json")
    hint = f"stepdeploy data prepare FILES --out {prefix}"
    with os.fdopen(open_regular(meta, "dataset description", hint), "rb") as handle:
        text = handle.read(MAX_DESCRIPTION_BYTES + 1)
    if len(text) > MAX_DESCRIPTION_BYTES:
        raise BadInput(f"{meta}: larger than a dataset description ({MAX_DESCRIPTION_BYTES:,} bytes); refused")
    corpus = Corpus.of(prefix, parse(safeio.loads_json(text, str(meta), what="dataset description"), meta))
    total = sum(len(read_checked(path, "dataset file", corpus.sha256[key], MAX_SHIPPED_BYTES))
                for key, path in zip(("bin", "idx"), corpus.files, strict=True))
    if total > MAX_SHIPPED_BYTES:
        raise BadInput(f"{prefix}: {total / 2**20:.0f} MiB; a dataset travels inside the run directory, at most "
                       f"{MAX_SHIPPED_BYTES // 2**20} MiB")
    return corpus


@dataclass(frozen=True)
class ShippedDataset:
    """A prepared dataset read for a run directory: its description and the bytes of its .bin and .idx (checked
    again against the description as they are read)."""

    corpus: Corpus
    blobs: dict[str, bytes]  # {".bin": ..., ".idx": ...}

    @classmethod
    def read(cls, corpus: Corpus) -> ShippedDataset:
        return cls(corpus, {path.suffix: read_checked(path, "dataset file", corpus.sha256[key], MAX_SHIPPED_BYTES)
                            for key, path in zip(("bin", "idx"), corpus.files, strict=True)})
