"""Files the package ships from the checkout's top level: the seed inventory (inventory/, which the help examples
name) and the docs (docs/, the text the demo trains on). pyproject.toml maps them into the wheel as
stepdeploy/seed/inventory and stepdeploy/seed/docs; in a checkout (an editable install) they are where they stand
(stepdeploy/resources.py, which finds playbooks/, roles/ and templates/ the same way)."""

from __future__ import annotations

from pathlib import Path

from stepdeploy.resources import shipped


def seed_path(name: str) -> Path:
    """`inventory/...` or `docs/...` as this install holds it: inside the wheel, else in the checkout."""
    return shipped(name, in_package=f"seed/{name}")


def shipped_inventory(given: str | Path) -> Path | None:
    """The packaged copy of a seed inventory a help example names (`inventory/dgx.ini`,
    `inventory/examples/...`), for a command run where no such file is: None when `given` exists or is no seed
    inventory."""
    path = Path(given)
    if path.exists() or path.is_absolute() or not path.parts or path.parts[0] != "inventory":
        return None
    copy = seed_path(path.as_posix())
    return copy if copy.is_file() else None
