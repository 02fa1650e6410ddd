"""Where CLI output goes: data to stdout (plain or --json), messages and progress to stderr.

rich already honours NO_COLOR and drops colour and animation when the stream is not a terminal.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)


def emit_json(data: Any) -> None:
    """Write one JSON document to stdout, bypassing rich so nothing is wrapped or styled."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def info(message: str) -> None:
    err.print(message, markup=False)
