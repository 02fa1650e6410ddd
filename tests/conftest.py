"""Fixtures shared by the unit and the integration tests."""

from __future__ import annotations

import pytest

from .wheel_venv import InstalledWheel, installed_wheel


@pytest.fixture(scope="session")
def wheel_install(tmp_path_factory: pytest.TempPathFactory) -> InstalledWheel:
    """stepdeploy's wheel, built from this checkout once per session and installed into a fresh venv."""
    return installed_wheel(tmp_path_factory.mktemp("wheel"))
