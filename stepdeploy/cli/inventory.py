"""`stepdeploy inventory ...` (being built)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Read an Ansible inventory into stepdeploy's cluster model.", no_args_is_help=True)


@app.command("show")
def show(path: str = typer.Argument(..., help="INI or YAML inventory.")) -> None:
    """Show the cluster an inventory describes."""
    raise NotImplementedError
