"""Project hygiene CI must keep true: the README's test command is what CI runs; the code is ruff-clean."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b.strip() for b in blocks]


CI_GUARD = ('status=$?; [ "$status" -eq 0 ] || { echo "ci: the README\'s demo command failed (exit $status)" >&2; '
            'exit "$status"; }')


def test_readme_has_exactly_two_setup_commands_and_ci_runs_both_the_demo_first() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert demo.endswith("stepdeploy demo") and "\n" not in demo
    assert "pytest" in tests and "\n" not in tests
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines()
                if line and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci_lines == [demo, CI_GUARD, tests]


def _ci_clone(tmp_path: Path, fail: dict[str, int]) -> tuple[Path, dict[str, str]]:
    """.ci/run in a directory of its own, every program it calls a stub that logs its name (and exits as `fail`
    says): the script's own control flow, run by bash as CI runs it."""
    root = tmp_path / "clone"
    (root / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci/run", root / ".ci/run")
    stubs, venv = tmp_path / "bin", root / ".venv/bin"
    stubs.mkdir()
    venv.mkdir(parents=True)
    log = tmp_path / "calls.log"
    for where, name in [(stubs, "apt-get"), (stubs, "python3"), (venv, "pip"), (venv, "stepdeploy"),
                        (venv, "python")]:
        code = fail.get(name, 0)
        (where / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexit {code}\n')
        (where / name).chmod(0o755)
    return log, {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path)}


@pytest.mark.parametrize(("fail", "code", "last"), [
    ({}, 0, "python -m pytest"),
    ({"stepdeploy": 1}, 1, "stepdeploy demo"),  # the demo's rollout failed: CI fails, the suite never starts
    ({"pip": 3}, 3, "pip install -q ."),  # a failure inside the demo's && chain, which set -e lets through
])
def test_ci_runs_the_demo_then_the_suite_and_a_failing_demo_fails_it(tmp_path: Path, fail: dict[str, int],
                                                                      code: int, last: str) -> None:
    log, env = _ci_clone(tmp_path, fail)
    res = subprocess.run(["bash", str(log.parent / "clone/.ci/run")], env=env, capture_output=True, text=True)
    calls = log.read_text().splitlines()
    assert res.returncode == code, res.stderr
    assert calls[-1] == last, calls
    if not fail:
        assert calls.index("stepdeploy demo") < calls.index("python -m pytest")
    else:
        assert "python -m pytest" not in calls
    # the guard speaks only for a failure set -e let through (the demo's own failure ends the script itself)
    assert ("ci: the README's demo command failed (exit 3)" in res.stderr) == ("pip" in fail)


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(__import__("sys").executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: the README's test command installs it ([test] extra); a linter that "
                    "is missing must fail, not skip, or the check it guards silently stops")
    res = subprocess.run([ruff, "check", "stepdeploy", "tests", "bench"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
