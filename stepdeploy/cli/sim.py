"""`stepdeploy sim ...` (being built)."""

from __future__ import annotations

import typer

app = typer.Typer(help="The embedded simulated cluster.", no_args_is_help=True)
