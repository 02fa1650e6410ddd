"""Read an inventory file with ansible-core's own InventoryManager, DataLoader and VariableManager.

This is the only module that talks to ansible. It narrows ansible's lenient behaviour to what stepdeploy
needs: only the `ini` and `yaml` inventory plugins; a source that no plugin can parse, or that a plugin
skips parts of, is an error (ansible would warn and carry on with an empty or partial inventory); and
nothing ansible says reaches the terminal: warnings are collected and either raised as BadInput or
returned. Values come back as plain Python types with the file:line they came from.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from stepdeploy.errors import BadInput

# ansible's own order: yaml declines files with other extensions, ini takes the rest
PLUGINS = ("yaml", "ini")
YAML_SUFFIXES = (".yml", ".yaml", ".json")
# Warnings after which ansible's inventory is still complete and unambiguous; everything else is fatal.
BENIGN_WARNINGS = ("Invalid characters were found in group names", "Found variable using reserved name")
_GENERIC_REASONS = ("Failed to parse inventory", "Unable to parse", "No inventory was parsed")
_TEXT_FAILURE = re.compile(r"^\[WARNING\]: Failed to parse inventory with '(\w+)' plugin: (?:Failed to parse "
                           r"inventory: )?(.*)$", re.MULTILINE)
_ORIGIN = re.compile(r"Origin: (?P<path>.+?):(?P<line>\d+)(?::\d+)?\s*$", re.MULTILINE)


@dataclass(frozen=True)
class RawHost:
    """One host as ansible resolved it: its groups and the variables stepdeploy asked for."""

    name: str
    groups: tuple[str, ...]
    variables: dict[str, Any]
    origins: dict[str, str] = field(default_factory=dict)  # variable -> "file:line" where it was set


@dataclass(frozen=True)
class RawInventory:
    hosts: list[RawHost]
    warnings: list[str]


def read_inventory(path: Path, wanted: Callable[[str], bool]) -> RawInventory:
    """Parse `path` (an existing file) and resolve each host's variables, keeping those `wanted` accepts."""
    with _quiet_ansible() as captured:
        try:
            manager, variables = _parse(path)
            hosts = [_raw_host(host, variables, wanted) for host in manager.get_hosts("all")]
        except BadInput:
            raise
        except Exception as exc:  # ansible raises many types (AnsibleError, YAML errors, OSError, ...)
            where = _exception_location(exc) or str(path)
            raise BadInput(f"{where}: {_one_line(_exception_text(exc))}") from exc
        messages = [*manager.parse_warnings, *captured.messages()]
    fatal = [m for m in messages if not _is_benign(m)]
    if fatal:  # e.g. a host_vars file a vars plugin could not combine
        raise BadInput(f"{path}: {_one_line(fatal[0])}")
    return RawInventory(hosts=hosts, warnings=_benign(messages))


def _parse(path: Path) -> tuple[Any, Any]:
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    manager = _strict_manager_class()(loader=loader, sources=[str(path)])
    return manager, VariableManager(loader=loader, inventory=manager)


@cache
def _strict_manager_class() -> type:
    from ansible.inventory.manager import InventoryManager
    from ansible.plugins.loader import inventory_loader

    class StrictInventoryManager(InventoryManager):  # type: ignore[misc]
        """InventoryManager limited to our plugins, failing instead of warning on an unparsable source."""

        parse_warnings: tuple[str, ...] = ()

        def _fetch_inventory_plugins(self) -> list[Any]:
            return [inventory_loader.get(name) for name in PLUGINS]

        def parse_source(self, source: str, cache: bool = False) -> bool:
            with _quiet_ansible() as captured:
                parsed = super().parse_source(source, cache=cache)
            fatal = [m for m in captured.messages() if not _is_benign(m)]
            if not parsed or fatal:
                raise BadInput(_parse_failure(Path(source), captured, parsed))
            self.parse_warnings = (*self.parse_warnings, *captured.messages())
            return parsed

    return StrictInventoryManager


def _raw_host(host: Any, variables: Any, wanted: Callable[[str], bool]) -> RawHost:
    resolved = variables.get_vars(host=host, include_hostvars=False)
    name = str(host.name)
    picked: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for key in sorted(str(k) for k in resolved):
        if not wanted(key):
            continue
        origin = _origin(resolved[key])
        if origin:
            origins[key] = origin
        picked[key] = _native(resolved[key], name, key, origin)
    groups = tuple(sorted(str(g.name) for g in host.get_groups() if g.name not in ("all", "ungrouped")))
    return RawHost(name=name, groups=groups, variables=picked, origins=origins)


def _native(value: Any, host: str, key: str, origin: str | None) -> Any:
    """A plain-Python copy of an ansible value (ansible tags strings/ints with their origin)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, list | tuple):
        return [_native(item, host, key, origin) for item in value]
    if isinstance(value, dict):
        return {str(k): _native(v, host, key, origin) for k, v in value.items()}
    where = origin or "inventory"
    raise BadInput(f"{where}: host {host!r}: {key} holds a value of type {type(value).__name__} that "
                   "stepdeploy cannot read (vault-encrypted or a custom YAML tag?); write it in plain text")


def _origin(value: Any) -> str | None:
    try:
        from ansible._internal._datatag._tags import Origin
    except ImportError:  # pragma: no cover - older/newer ansible without data tagging
        return None
    origin = Origin.get_tag(value)
    if origin is None or not origin.path:
        return None
    return _location(str(origin.path), origin.line_num)


def _location(path: str, line: int | None) -> str:
    """'path[:line]', the path relative to the working directory when it lies below it."""
    resolved = Path(path)
    with contextlib.suppress(ValueError):
        resolved = resolved.relative_to(Path.cwd())
    return f"{resolved}:{line}" if line else str(resolved)


# --- keeping ansible quiet -------------------------------------------------------------------------------


class _Captured:
    """Warnings ansible raised inside a capture: structured when ansible-core offers them, else text."""

    def __init__(self) -> None:
        self.context: Any = None  # ansible's DeferredWarningContext, when there is one
        # A real TextIOWrapper: ansible's Display patches and reconfigures sys.stdout/sys.stderr when it is
        # first created, and warns (on the real stderr) when they are plain StringIO objects.
        self._bytes = io.BytesIO()
        self.stream = io.TextIOWrapper(self._bytes, encoding="utf-8", errors="backslashreplace")

    def text(self) -> str:
        self.stream.flush()
        return self._bytes.getvalue().decode("utf-8", errors="backslashreplace")

    @property
    def summaries(self) -> list[Any]:
        return list(self.context.get_warnings()) if self.context is not None else []

    def messages(self) -> list[str]:
        if self.context is not None:
            return [_summary_text(s) for s in self.summaries]
        return [line.split("]:", 1)[-1].strip() for line in self.text().splitlines()
                if line.startswith("[WARNING]")]


@contextlib.contextmanager
def _quiet_ansible() -> Iterator[_Captured]:
    """Nothing ansible prints reaches stdout/stderr; its warnings are captured instead."""
    captured = _Captured()
    with (
        contextlib.redirect_stdout(captured.stream),
        contextlib.redirect_stderr(captured.stream),
        _deferred_warnings() as context,
    ):
        captured.context = context
        yield captured


@contextlib.contextmanager
def _deferred_warnings() -> Iterator[Any]:
    try:
        from ansible._internal._display_utils import DeferredWarningContext
    except ImportError:  # pragma: no cover - fall back to the redirected text
        yield None
        return
    with DeferredWarningContext(variables={}) as context:
        yield context


def _is_benign(message: str) -> bool:
    return message.startswith(BENIGN_WARNINGS)


def _benign(messages: list[str]) -> list[str]:
    return list(dict.fromkeys(m for m in messages if _is_benign(m)))


# --- turning ansible's failure into one line -------------------------------------------------------------


def _parse_failure(path: Path, captured: _Captured, parsed: bool) -> str:
    """One line: file[:line], then the most specific reason ansible gave, for the plugin the file suits."""
    if parsed:  # parsed, but a plugin skipped part of the file
        reason = next(m for m in captured.messages() if not _is_benign(m))
        where = _location(str(path), None)
        return f"{where}: {_one_line(reason)}; ansible would ignore that part of the inventory"
    failures = _plugin_failures(captured)
    if not failures:  # every plugin declined the file (e.g. a .toml suffix)
        return f"{_location(str(path), None)}: not an INI or YAML inventory ansible can parse"
    suited = "yaml" if path.suffix.lower() in YAML_SUFFIXES else "ini"
    plugin = suited if suited in failures else next(iter(failures))
    reason, line = failures[plugin]
    where = _location(str(path), line or _line_of(path, reason))
    return f"{where}: not a valid {plugin.upper()} inventory: {_one_line(reason)}"


def _plugin_failures(captured: _Captured) -> dict[str, tuple[str, int | None]]:
    """plugin name -> (most specific reason, line number if ansible knew it)."""
    failures: dict[str, tuple[str, int | None]] = {}
    for summary in captured.summaries:
        match = re.search(r"with '(\w+)' plugin", str(summary.event.msg))
        if match:
            failures[match.group(1)] = _deepest_reason(summary.event)
    if captured.context is None:  # no structured warnings: read ansible's text
        for match in _TEXT_FAILURE.finditer(captured.text()):
            failures[match.group(1)] = (match.group(2), None)
    return failures


def _deepest_reason(event: Any) -> tuple[str, int | None]:
    reason, line = str(event.msg), None
    while event is not None:
        msg = str(event.msg)
        if "\n" not in msg.strip() and not msg.startswith(_GENERIC_REASONS):
            reason = msg
        found = _ORIGIN.search(str(event.formatted_source_context or ""))
        if found:
            line = int(found.group("line"))
        chain = getattr(event, "chain", None)
        event = chain.event if chain is not None else None
    return reason, line


def _line_of(path: Path, reason: str) -> int | None:
    """ansible's INI parser drops the line number; find the line it quotes after 'got:'."""
    quoted = re.search(r"got: (.+)$", reason)
    if not quoted:
        return None
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    needle = quoted.group(1).strip()
    return next((n for n, text in enumerate(lines, 1) if needle and needle in text), None)


def _summary_text(summary: Any) -> str:
    return _deepest_reason(summary.event)[0]


def _exception_location(exc: BaseException) -> str | None:
    """file:line of the innermost ansible error in the chain that knows it (e.g. a bad group_vars file)."""
    found: str | None = None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        match = _ORIGIN.search(str(getattr(current, "_formatted_source_context", None) or ""))
        if match:
            found = _location(match.group("path"), int(match.group("line")))
        current = current.__cause__ or current.__context__
    return found


def _exception_text(exc: BaseException) -> str:
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    cause = exc.__cause__
    if cause is not None and str(cause) and str(cause) not in str(message):
        message = f"{message}: {cause}"
    return str(message)


def _one_line(text: str) -> str:
    return " ".join(text.split())
