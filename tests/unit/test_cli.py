"""CLI conventions: every --help shows an example, --version, documented exit codes, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer.main
from typer.core import TyperGroup
from typer.testing import CliRunner

from stepdeploy import __version__
from stepdeploy.cli.app import app


def _commands(group: TyperGroup, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, cmd in group.commands.items():
        path = (*prefix, name)
        if isinstance(cmd, TyperGroup):
            found += _commands(cmd, path)
        else:
            found.append(path)
    return found


COMMANDS = _commands(typer.main.get_command(app))


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stepdeploy", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_verbs_later_issues_fill_exist() -> None:
    top = {path[0] for path in COMMANDS}
    assert {"provision", "preflight", "plan", "render", "run", "rollout", "report", "sim", "inventory", "demo"} <= top
    assert {("rollout", v) for v in ("run", "status", "resume", "stop", "list")} <= set(COMMANDS)
    assert {("sim", v) for v in ("up", "down", "status", "ssh")} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_help_shows_an_example(path: tuple[str, ...]) -> None:
    runner = CliRunner()
    result = runner.invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example: stepdeploy " + path[0] in result.output


def test_version() -> None:
    res = _run("--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"stepdeploy {__version__}"


def test_unknown_option_is_bad_input_exit_2() -> None:
    res = _run("sim", "up", "--no-such-option")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("args, message", [
    (("sim", "up", "--name", "Bad_Name"), "cluster name"),
    (("sim", "up", "--subnet", "8.8.8.0/24"), "private IPv4 network"),
    (("sim", "up", "--nodes", "0"), "--nodes must be between"),
])
def test_sim_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    res = _run(*args)
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in res.stderr
