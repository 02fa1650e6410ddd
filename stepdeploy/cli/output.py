"""Where CLI output goes: data to stdout (plain or --json), messages and progress to stderr.

rich already honours NO_COLOR and drops colour and animation when the stream is not a terminal. Every console
here prints text as text: rich markup is off (a host, path or reason holding `[/x]` or `[red]` is shown as
typed, never parsed), and control characters from data (an escape sequence in a node name, a run id or a
reason) are shown escaped (`\\x1b`), never sent to the terminal.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.text import Text

from stepdeploy.safeio import json_safe

# C0 and C1 controls (not tab or newline), DEL, and the bidirectional overrides that can disguise text
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every control character written out (`\\x1b`, `\\u202e`); tabs and newlines kept."""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


class SafeConsole(Console):
    """A rich Console without markup that never writes a control character it did not make itself."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(markup=False, **kwargs)

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(printable(text), **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            if segment.control is None and _UNSAFE.search(segment.text):
                yield Segment(printable(segment.text), segment.style)
            else:
                yield segment


def console(**kwargs: Any) -> SafeConsole:
    """A console for data written somewhere else (a wide table on a pipe, a string in tests)."""
    return SafeConsole(**kwargs)


out = SafeConsole(highlight=False, soft_wrap=True)
err = SafeConsole(stderr=True, highlight=False)


def emit_json(data: Any) -> None:
    """Write one JSON document to stdout, bypassing rich so nothing is wrapped or styled. Standard JSON only:
    a NaN or infinity (a diverged loss) is written as null."""
    sys.stdout.write(json.dumps(json_safe(data), indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def info(message: str) -> None:
    err.print(message)


def warn(message: str) -> None:
    err.print(f"warning: {message}", soft_wrap=True)
