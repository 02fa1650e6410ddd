"""Running one fuzz case and judging it: the rules every stepdeploy command must keep, whatever it is given.

    no traceback; no hang (the case's time limit); not killed (memory limit, a signal);
    exit 0, 1 (a check or stage failed, nothing fits), 2 (bad input) or 3 (a node did not answer);
    exit 2: exactly one `error:` line on stderr (before it only warnings/notes/progress, after it at most a hint);
    no escape sequence from the input on the terminal; nothing executed (no PWNED marker);
    exit 2: nothing written, changed or left half-written in the case's directory.

A case is a directory (its files already made) and an argv. `Runner` sends it to the zygote (zygote.py) and
returns a `Verdict`; with STEPDEPLOY_FUZZ_STATS set, every case is also appended there as one JSON line
(bench/fuzz_cli.py reads them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ZYGOTE = Path(__file__).resolve().with_name("zygote.py")
MARKER = "PWNED"  # hostile values try to create this file; it must never appear
TIMEOUT_S = float(os.environ.get("STEPDEPLOY_FUZZ_TIMEOUT", "45"))
MEMORY = int(os.environ.get("STEPDEPLOY_FUZZ_MEMORY", str(3 * 1024**3)))
ALLOWED_RC = {0, 1, 2, 3}
# Tool state, not outputs: HOME (ansible's ~/.ansible), the sim state directory, sqlite's WAL side files.
_IGNORED = ("home/", "state/", "sim/")
_IGNORED_SUFFIXES = ("-wal", "-shm")


@dataclass
class Verdict:
    argv: list[str]
    rc: int
    seconds: float
    stdout: str
    stderr: str
    problems: list[str] = field(default_factory=list)
    maxrss_kib: int = 0

    def describe(self) -> str:
        tail = "\n".join(self.stderr.splitlines()[-25:])
        return (f"stepdeploy {' '.join(map(repr, self.argv))}\n  exit {self.rc} after {self.seconds:.1f} s: "
                f"{'; '.join(self.problems)}\n  stderr (tail):\n{tail}")


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime) of everything below `root`, tool state left out; links are not followed."""
    found: dict[str, tuple[int, int]] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            rel = path.relative_to(root).as_posix() + ("/" if name in dirs else "")
            if rel.startswith(_IGNORED) or rel.endswith(_IGNORED_SUFFIXES):
                continue
            info = path.lstat()
            found[rel] = (0, 0) if name in dirs else (info.st_size, info.st_mtime_ns)
    return found


def judge(argv: list[str], result: dict[str, Any], stdout: str, stderr: str, before: dict, after: dict,
          case_dir: Path) -> Verdict:
    verdict = Verdict(argv, result["rc"], result["seconds"], stdout, stderr, maxrss_kib=result.get("maxrss_kib", 0))
    problems = verdict.problems
    if result["timed_out"]:
        problems.append(f"hang: no exit within {TIMEOUT_S:g} s")
    elif result["rc"] < 0:
        problems.append(f"killed by signal {-result['rc']} (memory limit {MEMORY // 2**20} MiB?)")
    elif result["rc"] not in ALLOWED_RC:
        problems.append(f"exit code {result['rc']} (allowed: {sorted(ALLOWED_RC)})")
    if "Traceback (most recent call last)" in stderr or "Traceback (most recent call last)" in stdout:
        problems.append("traceback")
    if result["rc"] == 2 and not result["timed_out"]:
        problems += _one_error_line(stderr)
        changed = sorted(set(before.items()) ^ set(after.items()))
        if changed:
            problems.append(f"bad input, yet the case directory changed: {[c[0] for c in changed][:5]}")
    asks_help = "--help" in argv or "-h" in argv  # help wins over --json: it prints the usage, as it should
    if "--json" in argv and not asks_help and result["rc"] in (0, 1) and not result["timed_out"]:
        problems += _one_json_document(stdout)
    if "\x1b" in stdout or "\x1b" in stderr:
        problems.append("an escape sequence reached the terminal")
    if MARKER in _names(case_dir):  # `touch PWNED` ran (a file *named* "$(touch PWNED)" is only a name)
        problems.append("a hostile value was executed (PWNED marker)")
    return verdict


def _one_error_line(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    if len(errors) != 1:
        return [f"exit 2 with {len(errors)} 'error:' lines (want exactly 1)"]
    rest = lines[errors[0] + 1:]
    if len(rest) > 1 or (rest and not rest[0].startswith("hint: ")):
        return [f"lines after the error line: {rest[:3]}"]
    return []


def _one_json_document(stdout: str) -> list[str]:
    """--json: what stdout holds is exactly one JSON document (issue 22), whatever else went to stderr."""
    try:
        json.loads(stdout)
    except ValueError as exc:
        return [f"--json, exit 0/1, but stdout is not one JSON document ({exc}): {stdout[:120]!r}"]
    return []


def _names(root: Path) -> list[str]:
    return [name for _, dirs, files in os.walk(root) for name in dirs + files]


def realistic(argv: list[str]) -> list[str]:
    """argv as a real process could receive it: no NUL, only what os.fsencode can carry."""
    fixed = []
    for arg in argv:
        arg = arg.replace("\x00", "")
        try:
            os.fsencode(arg)
        except UnicodeEncodeError:
            arg = arg.encode("utf-8", "replace").decode("utf-8")
        fixed.append(arg)
    return fixed


class Runner:
    """One zygote process; restarted if it dies. Not thread-safe: one per thread."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def _zygote(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-I", str(ZYGOTE)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, cwd="/")
            assert self._proc.stdout is not None
            ready = self._proc.stdout.readline()
            if not ready.strip():
                raise RuntimeError("the fuzz zygote did not start")
        return self._proc

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def run(self, case_dir: Path, argv: list[str], env: dict[str, str] | None = None) -> Verdict:
        argv = realistic(argv)
        (case_dir / "home").mkdir(exist_ok=True)
        base_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(case_dir / "home"),
                    "LANG": "C.UTF-8", "NO_COLOR": "1", "COLUMNS": "120", "PYTHONDONTWRITEBYTECODE": "1",
                    "STEPDEPLOY_SIM_DIR": str(case_dir / "sim"), "XDG_STATE_HOME": str(case_dir / "state")}
        out, err = case_dir.parent / f"{case_dir.name}.out", case_dir.parent / f"{case_dir.name}.err"
        case = {"argv": argv, "cwd": str(case_dir), "env": {**base_env, **(env or {})}, "stdout": str(out),
                "stderr": str(err), "timeout": TIMEOUT_S, "memory": MEMORY}
        before = snapshot(case_dir)
        with self._lock:
            proc = self._zygote()
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(case) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the fuzz zygote died")
        result = json.loads(line)
        stdout = out.read_text(encoding="utf-8", errors="replace")
        stderr = err.read_text(encoding="utf-8", errors="replace")
        verdict = judge(argv, result, stdout, stderr, before, snapshot(case_dir), case_dir)
        _record(verdict)
        return verdict


def _record(verdict: Verdict) -> None:
    path = os.environ.get("STEPDEPLOY_FUZZ_STATS")
    if not path:
        return
    entry = {"command": " ".join(a for a in verdict.argv[:2] if not a.startswith("-"))[:40], "rc": verdict.rc,
             "seconds": verdict.seconds, "maxrss_kib": verdict.maxrss_kib, "problems": verdict.problems,
             "argv": verdict.argv if verdict.problems else None,
             "stderr": verdict.stderr[-3000:] if verdict.problems else None}
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
