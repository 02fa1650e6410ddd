"""Files a user hands stepdeploy, read safely; files stepdeploy writes, written whole or not at all.

Every input file (an inventory and its group_vars/host_vars, a manifest, a ledger, a facts file) goes through
here: it must be a regular file (a FIFO or a device would block or never end), of bounded size, and its
JSON/YAML must not nest or expand without bound (a YAML "billion laughs" of anchors and aliases is refused
before anything expands it). Problems are BadInput naming the file. Outputs are written to a temporary
sibling and renamed into place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stepdeploy.errors import BadInput

MAX_INPUT_BYTES = 8 * 1024 * 1024  # an inventory of thousands of hosts is a few hundred KiB
MAX_NESTING = 64  # levels of lists/objects in a JSON or YAML document
MAX_YAML_VALUES = 200_000  # values a YAML document may stand for once its aliases are expanded
MAX_VARS_FILES = 10_000  # files under one group_vars/ or host_vars/ directory


def _describe(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    kind = next((text for test, text in kinds if test(mode)), "of an unknown kind")
    return f"is not a regular file ({kind})"


def require_regular(path: Path, what: str) -> os.stat_result:
    """stat() of `path`, which must exist and be a regular file (links are followed); BadInput otherwise."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such {what}") from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise BadInput(f"{path}: {_describe(info.st_mode)}; refusing to read it as the {what}")
    return info


def read_bytes(path: Path, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The content of a regular file of at most `limit` bytes. The file is opened without blocking and
    checked after opening, so one swapped for a FIFO between a check and the read cannot hang the reader."""
    require_regular(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise BadInput(f"{path}: {_describe(info.st_mode)}; refusing to read it as the {what}")
        if info.st_size > limit:
            raise BadInput(f"{path}: the {what} is {info.st_size:,} bytes; more than {limit:,} is refused")
        try:
            data = handle.read(limit + 1)
        except OSError as exc:
            raise BadInput(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise BadInput(f"{path}: the {what} is more than {limit:,} bytes; refused")
    return data


def read_text(path: Path, what: str, limit: int = MAX_INPUT_BYTES) -> str:
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: the {what} is not UTF-8 text (byte {exc.start})") from None


# --- JSON --------------------------------------------------------------------------------------------------


def loads_json(text: str | bytes, source: str, *, what: str = "document", hint: str | None = None) -> Any:
    """json.loads that refuses (BadInput naming `source`) what is not JSON or nests deeper than MAX_NESTING."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise BadInput(f"{source}: nested deeper than {MAX_NESTING} levels; refused", hint=hint) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput(f"{source}: not a JSON {what} ({exc})", hint=hint) from None
    if nesting(data) > MAX_NESTING:
        raise BadInput(f"{source}: nested deeper than {MAX_NESTING} levels; refused", hint=hint)
    return data


def json_safe(value: Any) -> Any:
    """`value` with every NaN or infinity replaced by None: what standard JSON can hold (json.dumps would
    write the bare words NaN and Infinity, which JSON readers other than Python's refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def read_json(path: Path, what: str, *, hint: str | None = None, limit: int = MAX_INPUT_BYTES) -> Any:
    return loads_json(read_bytes(path, what, limit), str(path), what=what, hint=hint)


def nesting(value: Any, limit: int = MAX_NESTING) -> int:
    """How deeply lists and dicts nest in `value` (iterative: none overflows), stopping once past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


# --- YAML -------------------------------------------------------------------------------------------------


def check_yaml(text: str, source: str) -> None:
    """Refuse a YAML text whose aliases would expand past MAX_YAML_VALUES values, that refers to itself, or
    that nests deeper than MAX_NESTING. Reads libyaml's event stream (no recursion, nothing expanded); a text
    that is not YAML at all is left to the real parser to report."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    sizes: dict[str, int] = {}  # anchor -> values the anchored node stands for
    stack: list[list[Any]] = []  # open collections: [values so far, anchor]
    total = 0
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.CollectionStartEvent):
                stack.append([0, event.anchor])
                if len(stack) > MAX_NESTING:
                    raise BadInput(f"{source}: nested deeper than {MAX_NESTING} levels; refused")
                continue
            if isinstance(event, yaml.CollectionEndEvent):
                count, anchor = stack.pop()
                size = count + 1
                if anchor is not None:
                    sizes[anchor] = size
            elif isinstance(event, yaml.ScalarEvent):
                size = 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                if any(anchor == event.anchor for _, anchor in stack):
                    raise BadInput(f"{source}: the YAML alias *{event.anchor} refers to the node that holds it; "
                                   "refused")
                size = sizes.get(event.anchor, 1)
            else:
                continue
            if stack:
                stack[-1][0] += size
            else:
                total += size
            if total + sum(count for count, _ in stack) > MAX_YAML_VALUES:
                raise BadInput(f"{source}: its YAML anchors and aliases expand to more than {MAX_YAML_VALUES:,} "
                               "values (a 'billion laughs'?); refused")
    except yaml.YAMLError:
        return  # not YAML: ansible's own parser says where


def check_vars_tree(directory: Path) -> None:
    """Every file ansible would read below a group_vars/ or host_vars/ directory is a regular file of bounded
    size whose YAML cannot explode; refuses FIFOs, devices, sockets and directory loops (which would block or
    never end)."""
    seen: set[tuple[int, int]] = set()
    for files, (path, info) in enumerate(_walk(directory, seen), 1):
        if files > MAX_VARS_FILES:
            raise BadInput(f"{directory}: holds more than {MAX_VARS_FILES:,} files; refused")
        if not stat.S_ISREG(info.st_mode):
            raise BadInput(f"{path}: {_describe(info.st_mode)}; ansible would read it as variables: remove it")
        if path.suffix.lower() in ("", ".yml", ".yaml", ".json"):
            check_yaml(read_text(path, "variables file"), str(path))


def _walk(directory: Path, seen: set[tuple[int, int]]) -> Iterator[tuple[Path, os.stat_result]]:
    pending = [directory]
    while pending:
        current = pending.pop()
        try:
            info = current.stat()
            entries = sorted(current.iterdir())
        except OSError as exc:
            raise BadInput(f"{current}: cannot read the directory: {exc.strerror or exc}") from None
        if (info.st_dev, info.st_ino) in seen:
            raise BadInput(f"{current}: a directory loop (symbolic link to a parent); refused")
        seen.add((info.st_dev, info.st_ino))
        for entry in entries:
            if entry.name.startswith("."):
                continue  # ansible skips hidden files too
            try:
                entry_info = entry.stat()
            except OSError as exc:
                raise BadInput(f"{entry}: cannot read it: {exc.strerror or exc}") from None
            if stat.S_ISDIR(entry_info.st_mode):
                pending.append(entry)
            else:
                yield entry, entry_info


# --- writing ----------------------------------------------------------------------------------------------


def check_output_file(path: Path, what: str) -> None:
    """`path` can take a new file: it is not a directory or special file, and its parent is (or can become) a
    writable directory. Raised before anything is written."""
    if path.is_dir():
        raise BadInput(f"{path}: is a directory; give a file name for the {what}")
    if path.exists() and not path.is_file():
        raise BadInput(f"{path}: exists and is not a regular file; give another name for the {what}")
    check_output_dir(path.parent, what)


def check_output_dir(directory: Path, what: str) -> None:
    """`directory` is a writable directory, or the nearest existing ancestor is one in which it can be made."""
    probe = directory
    while not probe.exists():
        if probe.is_symlink():
            raise BadInput(f"{probe}: a dangling symbolic link; cannot write the {what} there")
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise BadInput(f"{probe}: is not a directory; cannot write the {what} below it")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise BadInput(f"{probe}: is not writable; cannot write the {what} there")


def write_atomic(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """Write `data` to a temporary file beside `path` and rename it into place: readers see the old file or
    the whole new one, and a failure leaves nothing behind."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _foreign_link(link: os.stat_result, holder: os.stat_result) -> bool:
    """A symbolic link the kernel's fs.protected_symlinks would not follow: in a sticky, world-writable directory
    (/tmp), owned neither by us nor by the directory's owner."""
    shared = holder.st_mode & stat.S_ISVTX and holder.st_mode & stat.S_IWOTH
    return bool(shared) and link.st_uid not in (os.geteuid(), holder.st_uid)


def refuse_foreign_links(path: Path, what: str) -> None:
    """Refuse (BadInput) a `path` one of whose existing components is a symbolic link another user planted in a
    sticky world-writable directory such as /tmp: following it would write the `what` wherever that user chose.
    Our own links, and links in directories only trusted users can write, are followed as usual."""
    current = Path(path.anchor) if path.is_absolute() else Path()
    for part in path.parts[1:] if path.is_absolute() else path.parts:
        current = current / part
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            return  # made by us from here on
        except OSError as exc:
            raise BadInput(f"{current}: cannot check it: {exc.strerror or exc}") from None
        if not stat.S_ISLNK(info.st_mode):
            continue
        try:
            holder = os.stat(current.parent)
        except OSError as exc:
            raise BadInput(f"{current.parent}: cannot check it: {exc.strerror or exc}") from None
        if _foreign_link(info, holder):
            raise BadInput(f"{current}: a symbolic link owned by uid {info.st_uid} in the shared directory "
                           f"{current.parent}; refusing to follow it to write the {what}",
                           hint="give a path that does not go through another user's link")
