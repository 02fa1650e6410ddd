"""`stepdeploy render` (being built)."""

from __future__ import annotations

import typer

from stepdeploy.errors import NotImplementedYet


def render(args: list[str] | None = typer.Argument(None)) -> None:
    """[not built yet: exits 5]"""
    raise NotImplementedYet("`stepdeploy render` is not built yet in this version")
