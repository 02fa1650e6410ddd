"""`stepdeploy plan` (being built)."""

from __future__ import annotations

import typer

from stepdeploy.errors import NotImplementedYet


def plan(args: list[str] | None = typer.Argument(None)) -> None:
    """Rank parallel layouts by memory and step time; refuse what cannot work. [not built yet: exits 5]"""
    raise NotImplementedYet("`stepdeploy plan` is not built yet in this version")
