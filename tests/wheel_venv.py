"""stepdeploy as a user gets it from a wheel: built from this checkout, installed into a fresh venv outside it.

The build runs offline (`pip wheel --no-deps --no-build-isolation` with the setuptools of the Python running
the tests) on a copy of the files the build reads, so it leaves nothing in the checkout. The wheel goes into
the new venv with `--no-deps`; its third-party dependencies come from the tests' own site-packages, named by a
path line in a .pth file (a path line does not run that directory's own .pth files, so an editable install of
stepdeploy there is not picked up: `stepdeploy` is the wheel's or nothing). The console scripts those
dependencies would have put in the venv's bin/ (ansible-playbook, ...) are written there too, for the venv's
Python, as pip writes them: Ansible's filter plugin imports stepdeploy, so it must be the wheel's.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What setuptools reads to build the wheel: the top-level playbooks/, roles/ and templates/ ship as
# stepdeploy/<name>, inventory/ and docs/ as stepdeploy/seed/<name> (pyproject.toml's package-dir).
SHIPPED_AS = {"playbooks": "stepdeploy/playbooks", "roles": "stepdeploy/roles", "templates": "stepdeploy/templates",
              "inventory": "stepdeploy/seed/inventory", "docs": "stepdeploy/seed/docs"}
BUILD_INPUTS = ("pyproject.toml", "README.md", "stepdeploy", *SHIPPED_AS)
SCRIPTS_OF = ("ansible-core", "ansible-runner")  # dependencies whose console scripts stepdeploy runs


@dataclass
class InstalledWheel:
    wheel: Path
    venv: Path
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def stepdeploy(self) -> Path:
        return self.venv / "bin" / "stepdeploy"

    def names(self) -> list[str]:
        with zipfile.ZipFile(self.wheel) as whl:
            return whl.namelist()

    def env(self) -> dict[str, str]:
        """The environment of a user of the venv: nothing points back at this checkout."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env

    def run(self, *argv: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(a) for a in argv], cwd=cwd, env=self.env(), capture_output=True, text=True,
                              timeout=timeout)


def _timed(timings: dict[str, float], name: str, argv: list[str], **kwargs: object) -> None:
    started = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kwargs)  # type: ignore[call-overload]
    timings[name] = time.monotonic() - started
    assert res.returncode == 0, f"{' '.join(argv)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


def build_wheel(workdir: Path, timings: dict[str, float]) -> Path:
    source = workdir / "source"
    source.mkdir(parents=True)
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, source / name)
    dist = workdir / "dist"
    _timed(timings, "build", [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                              "--no-cache-dir", "--disable-pip-version-check", "-q", "-w", str(dist), str(source)],
           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    (wheel,) = dist.glob("stepdeploy-*.whl")
    return wheel


def _write_console_scripts(venv: Path) -> None:
    for dist in SCRIPTS_OF:
        for ep in importlib.metadata.distribution(dist).entry_points.select(group="console_scripts"):
            module, _, attr = ep.value.partition(":")
            script = venv / "bin" / ep.name
            script.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom {module} import {attr}\n"
                              f"sys.exit({attr}())\n")
            script.chmod(0o755)


def install(wheel: Path, venv: Path, timings: dict[str, float]) -> InstalledWheel:
    _timed(timings, "venv", [sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _timed(timings, "install", [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", "--disable-pip-version-check", "-q", str(wheel)])
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "stepdeploy-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _write_console_scripts(venv)
    return InstalledWheel(wheel=wheel, venv=venv, timings=timings)


def installed_wheel(workdir: Path) -> InstalledWheel:
    timings: dict[str, float] = {}
    return install(build_wheel(workdir / "build", timings), workdir / "venv", timings)
