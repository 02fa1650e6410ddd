"""The roles and playbooks pass ansible-lint's production profile (the strictest)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ANSIBLE = REPO_ROOT  # playbooks/ and roles/: the checkout's top level (the design card's layout)


def _ansible_lint() -> str | None:
    beside_python = Path(sys.executable).parent / "ansible-lint"
    return str(beside_python) if beside_python.exists() else shutil.which("ansible-lint")


def test_roles_and_playbooks_pass_the_production_profile() -> None:
    lint = _ansible_lint()
    if lint is None:
        pytest.fail("ansible-lint is not installed: the README's test command installs it ([test] extra); a "
                    "linter that is missing must fail, not skip")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles"), "NO_COLOR": "1", "ANSIBLE_LINT_SKIP_VERSION_CHECK": "1"}
    res = subprocess.run([lint, "--profile", "production", "--offline", str(ANSIBLE.relative_to(REPO_ROOT) / "roles"),
                          str(ANSIBLE.relative_to(REPO_ROOT) / "playbooks")], cwd=REPO_ROOT,
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, f"ansible-lint failed:\n{res.stdout}\n{res.stderr}"
    assert "Profile 'production' was required, and it passed" in res.stderr + res.stdout
