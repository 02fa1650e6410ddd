"""Where `stepdeploy provision` finds site.yml and the roles: in the package, or under STEPDEPLOY_HOME."""

from __future__ import annotations

from pathlib import Path

import pytest

import stepdeploy
from stepdeploy import resources
from stepdeploy.errors import MissingPrerequisite
from stepdeploy.provision.runner import playbooks_dir, roles_dir

PACKAGE = Path(stepdeploy.__file__).resolve().parent


def test_a_checkout_runs_its_top_level_playbooks_and_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests run from the checkout, whose playbooks/ and roles/ stand beside stepdeploy/ (the installed
    wheel's copies under the package: tests/unit/test_wheel.py)."""
    monkeypatch.delenv("STEPDEPLOY_HOME", raising=False)
    assert playbooks_dir() == PACKAGE.parent / "playbooks"
    assert roles_dir() == PACKAGE.parent / "roles"
    assert (playbooks_dir() / "site.yml").is_file() and (roles_dir() / "common" / "tasks" / "main.yml").is_file()


def test_a_copy_inside_the_package_wins_over_the_checkouts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """As in an installed wheel: stepdeploy/roles, stepdeploy/seed/inventory; else the top level's."""
    package = tmp_path / "site" / "stepdeploy"
    (package / "roles").mkdir(parents=True)
    (package / "seed" / "inventory").mkdir(parents=True)
    monkeypatch.setattr(resources, "PACKAGE", package)
    assert resources.roles_dir() == package / "roles"
    assert resources.shipped("inventory", in_package="seed/inventory") == package / "seed" / "inventory"
    assert resources.playbooks_dir() == tmp_path / "site" / "playbooks"
    assert resources.templates_dir() == tmp_path / "site" / "templates"


def test_stepdeploy_home_names_a_copy_of_both(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "playbooks").mkdir()
    monkeypatch.setenv("STEPDEPLOY_HOME", str(tmp_path))
    assert playbooks_dir() == tmp_path / "playbooks" and roles_dir() == tmp_path / "roles"


def test_a_stepdeploy_home_without_playbooks_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("STEPDEPLOY_HOME", str(tmp_path))
    with pytest.raises(MissingPrerequisite) as exc:
        playbooks_dir()
    assert str(tmp_path / "playbooks") in exc.value.message
    assert exc.value.hint is not None and "unset STEPDEPLOY_HOME" in exc.value.hint
