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


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert demo.endswith("stepdeploy demo") and "\n" not in demo
    assert "pytest" in tests and "\n" not in tests
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines()
                if line and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci_lines == [tests]


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(__import__("sys").executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it is in the [test] extra)")
    res = subprocess.run([ruff, "check", "stepdeploy", "tests", "bench"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
