"""A probe as one shell command: named sections, each under its own timeout and framed by markers, so one
slow or failing reading costs its own section and the output splits back into {section: (rc, text)}.
Pure: text in, text out. Used by preflight's probe and the soak monitors' probe."""

from __future__ import annotations

import base64
import re
import shlex


def script(mark: str, commands: dict[str, str], timeout_s: int) -> str:
    """Every section framed by `mark` lines (begin NAME / end NAME RC), each under `timeout -k 2`."""
    lines = ["exec 2>&1"]
    for name, cmd in commands.items():
        lines.append(f"echo '{mark} begin {name}'")
        lines.append(f"timeout -k 2 {int(timeout_s)} sh -c {shlex.quote(cmd)} </dev/null; rc=$?")
        lines.append(f"echo; echo \"{mark} end {name} $rc\"")
    return "\n".join(lines) + "\n"


def remote_command(script_text: str) -> str:
    """A one-line command that runs the script under sh wherever the login shell is (base64 spares it every
    quoting problem)."""
    return f"echo {base64.b64encode(script_text.encode()).decode()} | base64 -d | sh"


def split(mark: str, output: str) -> dict[str, tuple[int, str]]:
    """Probe output -> {section: (rc, text)}. A section cut off (the node died mid-probe) is absent."""
    pattern = re.compile(rf"^{re.escape(mark)} begin (\S+)\n(.*?)\n?^{re.escape(mark)} end \1 (\d+)$",
                         re.MULTILINE | re.DOTALL)
    return {m.group(1): (int(m.group(3)), m.group(2).rstrip("\n")) for m in pattern.finditer(output)}
