"""Where this install holds the files the package ships from the checkout's top level.

The design card puts `playbooks/`, `roles/`, `templates/`, `inventory/` and `docs/` at the top level of the
repository, where an Ansible user looks; pyproject.toml's package-dir maps each into the wheel under the package
(`stepdeploy/playbooks`, `stepdeploy/roles`, `stepdeploy/templates`; the seed inventory and docs as
`stepdeploy/seed/inventory` and `stepdeploy/seed/docs`). An installed wheel finds them there; a checkout (an
editable install, or PYTHONPATH) has no copy inside the package and finds them where they stand. (Paths, not
`importlib.resources.files("stepdeploy.roles")`: setuptools' editable install does not import such a mapped
directory as a package.) tests/unit/test_wheel.py proves the wheel holds every one of their files."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def shipped(name: str, in_package: str | None = None) -> Path:
    """`name` (a top-level directory of the checkout, or a path under one) as this install holds it: the copy
    inside the package (at `in_package`, by default `name`) when there is one, else the checkout's."""
    inside = PACKAGE / (in_package or name)
    return inside if inside.exists() else PACKAGE.parent / name


def playbooks_dir() -> Path:
    """site.yml, compat.yml, their group_vars/ and filter_plugins/."""
    return shipped("playbooks")


def roles_dir() -> Path:
    return shipped("roles")


def templates_dir() -> Path:
    """The Jinja templates render/ and report/ fill."""
    return shipped("templates")
