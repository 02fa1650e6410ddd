"""Verbs whose implementation arrives with later issues.

They are registered now so the command tree, help and exit codes are stable; each says plainly that it is
not built yet and exits 5, never pretending to have done anything.
"""

from __future__ import annotations

import typer

from stepdeploy.errors import NotImplementedYet

_PENDING: dict[str, tuple[str, str]] = {}


def register(app: typer.Typer) -> None:
    for verb, (help_text, example) in _PENDING.items():
        _add(app, verb, help_text, example)
    rollout = typer.Typer(help="Staged rollout: warmup, scaling ladder, soak (not built yet).",
                          no_args_is_help=True)
    for verb in ("run", "status", "resume", "stop", "list"):
        _add(rollout, verb, f"rollout {verb} (not built yet).", f"stepdeploy rollout {verb} ...",
             prefix="rollout ")
    app.add_typer(rollout, name="rollout")


def _add(app: typer.Typer, verb: str, help_text: str, example: str, prefix: str = "") -> None:
    def command(
        args: list[str] | None = typer.Argument(None, help="Arguments, once the verb exists."),
    ) -> None:
        raise NotImplementedYet(f"`stepdeploy {prefix}{verb}` is not built yet in this version")

    app.command(
        name=verb,
        help=f"{help_text} [not built yet: exits 5]",
        epilog=f"Example: {example}",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )(command)
