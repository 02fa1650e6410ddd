"""Where `stepdeploy provision` finds site.yml and the roles: in the package, or under STEPDEPLOY_HOME."""

from __future__ import annotations

from pathlib import Path

import pytest

import stepdeploy
from stepdeploy.errors import MissingPrerequisite
from stepdeploy.provision.runner import playbooks_dir, roles_dir

PACKAGE = Path(stepdeploy.__file__).parent


def test_the_package_ships_the_playbooks_and_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPDEPLOY_HOME", raising=False)
    assert playbooks_dir() == PACKAGE / "ansible" / "playbooks"
    assert roles_dir() == PACKAGE / "ansible" / "roles"
    assert (playbooks_dir() / "site.yml").is_file() and (roles_dir() / "common" / "tasks" / "main.yml").is_file()


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
