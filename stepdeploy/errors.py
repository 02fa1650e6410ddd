"""Errors that end a command with a one-line message and a documented exit code.

Exit codes (also in README and `stepdeploy --help`):
  0  success
  1  checks or stages ran and at least one failed
  2  bad input: inventory, option, file the user gave
  3  nodes unreachable
  4  this machine lacks a prerequisite (root, a host package, kernel feature)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
EXIT_PREREQUISITE = 4


class StepdeployError(Exception):
    """Base: carries the exit code and an optional hint (the next command to run)."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class BadInput(StepdeployError):
    exit_code = EXIT_BAD_INPUT


class Unreachable(StepdeployError):
    exit_code = EXIT_UNREACHABLE


class MissingPrerequisite(StepdeployError):
    exit_code = EXIT_PREREQUISITE
