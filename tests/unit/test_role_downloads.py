"""Issue 18: what a role downloads and runs as root is checksummed and kept where only root can write.

The conda path of roles/python_env used to download Miniforge to /var/tmp/miniforge-installer.sh without a
checksum or `force`: a file another user planted there first survived an If-Modified-Since answer and ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

ROLES = Path(__file__).resolve().parents[2] / "roles"
SHARED = ("/tmp", "/var/tmp", "/dev/shm")


def tasks(path: Path) -> list[dict[str, Any]]:
    found = []
    for task in yaml.safe_load(path.read_text()) or []:
        found += [task, *task.get("block", [])]
    return found


def downloads() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, task["ansible.builtin.get_url"]) for path in sorted(ROLES.glob("*/tasks/*.yml"))
            for task in tasks(path) if "ansible.builtin.get_url" in task]


def test_every_download_can_be_checksummed_and_none_goes_to_a_shared_directory() -> None:
    assert downloads()
    for path, args in downloads():
        assert "checksum" in args, f"{path}: get_url without a checksum"
        assert not str(args["dest"]).startswith(SHARED), f"{path}: downloads into a shared directory"


def test_the_conda_installer_is_checksummed_forced_and_private() -> None:
    conda = tasks(ROLES / "python_env/tasks/conda.yml")
    get = next(t["ansible.builtin.get_url"] for t in conda if "ansible.builtin.get_url" in t)
    assert get["checksum"] == "{{ __python_env_conda_checksum }}" and get["force"] is True
    assert get["dest"] == "{{ __python_env_conda_installer }}"
    private = next(t["ansible.builtin.file"] for t in conda
                   if t.get("name") == "Create the private installer directory")
    assert private == {"path": "{{ python_env_installer_dir }}", "state": "directory", "owner": "root",
                       "group": "root", "mode": "0700"}
    argv = next(t["ansible.builtin.command"]["argv"] for t in conda if "Install Miniforge into" in t.get("name", ""))
    assert argv[1] == "{{ __python_env_conda_installer }}"
    assert not any("/var/tmp" in str(t) or "/tmp/" in str(t) for t in conda)


def _conda_checksum(arch: str, **overrides: str) -> str:
    values = {**yaml.safe_load((ROLES / "python_env/defaults/main.yml").read_text()),
              **yaml.safe_load((ROLES / "python_env/vars/main.yml").read_text()), **overrides}
    values = {k: v for k, v in values.items() if k.startswith(("python_env_conda_installer", "__python_env_conda_"))
              and k != "__python_env_conda_installer"}
    values["ansible_facts"] = {"architecture": arch}
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    for _ in range(4):  # the variables refer to each other: render until nothing changes
        values = {k: env.from_string(v).render(values) if isinstance(v, str) else v for k, v in values.items()}
    return values["__python_env_conda_checksum"].strip()


@pytest.mark.parametrize(("arch", "overrides", "expected"), [
    ("x86_64", {}, "sha256:2e1ad2188fe69fcdd522c2b20c08c800a5c7411b775eca768318b1540ed32e53"),
    ("aarch64", {}, ""),  # no digest pinned: validation stops the play and asks for one
    ("x86_64", {"python_env_conda_installer_url": "https://mirror.example/Miniforge3.sh"}, ""),
    ("aarch64", {"python_env_conda_installer_checksum": "sha256:" + "ab" * 32}, "sha256:" + "ab" * 32),
])
def test_the_checksum_is_the_pinned_one_or_the_users(arch: str, overrides: dict[str, str], expected: str) -> None:
    assert _conda_checksum(arch, **overrides) == expected


def test_validation_refuses_a_download_without_a_checksum() -> None:
    checks = tasks(ROLES / "python_env/tasks/validate.yml")
    assert any("__python_env_conda_checksum is match('^sha256:[0-9a-f]{64}$')" in a["ansible.builtin.assert"]["that"]
               for a in checks if "ansible.builtin.assert" in a)
