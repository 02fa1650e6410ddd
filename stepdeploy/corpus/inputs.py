"""The documents of `stepdeploy data prepare`'s inputs: a text file is one document; a `.jsonl` file holds one
per line (an object whose `--json-key` field is the text). Every input is a regular file (a FIFO, device or socket
is refused, never read), UTF-8 and not empty; a problem is one BadInput naming the file and the byte or line."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from stepdeploy.errors import BadInput

JSONL_SUFFIX = ".jsonl"
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


@dataclass(frozen=True)
class Source:
    path: Path
    size: int

    @property
    def jsonl(self) -> bool:
        return self.path.suffix.lower() == JSONL_SUFFIX


def _not_regular(path: Path, mode: int) -> BadInput:
    kind = next((text for test, text in _KINDS if test(mode)), "not a regular file")
    return BadInput(f"{path}: {kind}; refusing to read it as text", hint="give regular text files or directories")


def _source(path: Path) -> Source:
    try:
        info = path.stat()
    except OSError as exc:
        raise BadInput(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, info.st_mode)
    return Source(path, info.st_size)


def _walk(directory: Path) -> Iterator[Path]:
    """Every file below `directory`, sorted; links to directories are not followed (no loops)."""
    def fail(exc: OSError) -> None:
        raise BadInput(f"{exc.filename}: cannot read the directory: {exc.strerror or exc}")

    for root, dirs, files in os.walk(directory, onerror=fail):
        dirs.sort()
        yield from (Path(root) / name for name in sorted(files))


def find_sources(paths: Iterable[Path]) -> list[Source]:
    """The input files, in the order given (a directory's files sorted); anything but a regular file refused."""
    found: list[Source] = []
    for path in paths:
        try:
            info = path.stat()
        except OSError:
            raise BadInput(f"{path}: not a file or directory", hint="give text files or directories of them") from None
        if stat.S_ISDIR(info.st_mode):
            found += [_source(p) for p in _walk(path)]
        elif stat.S_ISREG(info.st_mode):
            found.append(Source(path, info.st_size))
        else:
            raise _not_regular(path, info.st_mode)
    if not found:
        raise BadInput("no input files", hint="give text files or directories of them: "
                       "stepdeploy data prepare texts/ --out data/corpus")
    return found


def _open(source: Source) -> int:
    try:
        fd = os.open(source.path, _OPEN_FLAGS)
    except OSError as exc:
        raise BadInput(f"{source.path}: cannot read it: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped for something else since it was found
        os.close(fd)
        raise _not_regular(source.path, mode)
    return fd


def _decode(data: bytes, where: str, offset: int = 0) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{where}: not UTF-8 text (byte {offset + exc.start})",
                       hint="convert it to UTF-8 (iconv -t UTF-8) or leave it out") from None


def _text_document(source: Source) -> str:
    with os.fdopen(_open(source), "rb") as handle:
        try:
            data = handle.read()
        except OSError as exc:
            raise BadInput(f"{source.path}: cannot read it: {exc.strerror or exc}") from None
    if not data:
        raise BadInput(f"{source.path}: empty; nothing to tokenize", hint="leave it out")
    return _decode(data, str(source.path))


def _line_document(line: bytes, where: str, offset: int, key: str) -> str:
    text = _decode(line, where, offset)
    try:
        value = json.loads(text)
    except RecursionError:
        raise BadInput(f"{where}: nested too deeply; refused") from None
    except ValueError as exc:
        raise BadInput(f"{where}: not JSON ({exc})", hint="a .jsonl file holds one JSON object per line") from None
    if not isinstance(value, dict):
        raise BadInput(f"{where}: a JSON {type(value).__name__} where an object was expected",
                       hint="a .jsonl file holds one JSON object per line")
    if key not in value:
        raise BadInput(f"{where}: no {key!r} field", hint="name the text's field with --json-key")
    document = value[key]
    if not isinstance(document, str):
        raise BadInput(f"{where}: its {key!r} field is a {type(document).__name__}, not text")
    if not document:
        raise BadInput(f"{where}: its {key!r} field is empty; nothing to tokenize")
    return document


def _lines(handle: BinaryIO, path: Path) -> Iterator[bytes]:
    while True:
        try:
            line = handle.readline()
        except OSError as exc:
            raise BadInput(f"{path}: cannot read it: {exc.strerror or exc}") from None
        if not line:
            return
        yield line


def _jsonl_documents(source: Source, key: str) -> Iterator[tuple[str, int]]:
    offset, count = 0, 0
    with os.fdopen(_open(source), "rb") as handle:
        for number, line in enumerate(_lines(handle, source.path), 1):
            if line.strip():
                count += 1
                yield _line_document(line, f"{source.path}:{number}", offset, key), len(line)
            else:
                yield "", len(line)  # no document; only the bytes read, for the progress bar
            offset += len(line)
    if not count:
        raise BadInput(f"{source.path}: empty; no documents to tokenize", hint="leave it out")


def documents(sources: Iterable[Source], key: str) -> Iterator[tuple[str, int]]:
    """(text, input bytes it took) for every document in order; ("", n) for n bytes that held none."""
    for source in sources:
        if source.jsonl:
            yield from _jsonl_documents(source, key)
        else:
            yield _text_document(source), source.size
