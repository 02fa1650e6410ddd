"""The package sources the simulated nodes use, served over HTTP on the bridge: a local apt repository
(`deb [trusted=yes] http://BRIDGE:PORT/apt ./`) and a wheelhouse (pip find-links). Nodes have no other
route, so this is also how an air-gapped mirror behaves."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from stepdeploy.errors import BadInput
from stepdeploy.sim import host
from stepdeploy.sim.state import SimState, is_ours, process_start_time


def repo_dir(state_dir: Path) -> Path:
    return state_dir / "repo"


def ensure_layout(state_dir: Path, wheelhouse: Path | None = None) -> None:
    """Create the repository; seed its wheelhouse with the controller's (the wheels the base was built
    from: torch CPU and its dependencies), so nodes can build environments offline."""
    apt = repo_dir(state_dir) / "apt"
    apt.mkdir(parents=True, exist_ok=True)
    wheels = repo_dir(state_dir) / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not (apt / "Packages").exists():
        reindex_apt(state_dir)
    for wheel in sorted(wheelhouse.glob("*.whl")) if wheelhouse else []:
        target = wheels / wheel.name
        if not target.exists():
            try:
                os.link(wheel, target)
            except OSError:  # another filesystem
                shutil.copy2(wheel, target)


def reindex_apt(state_dir: Path) -> None:
    index_flat(repo_dir(state_dir) / "apt")


def index_flat(directory: Path) -> None:
    """Packages and Packages.gz for a flat repository (`deb [trusted=yes] URL ./`)."""
    packages = host.run(["dpkg-scanpackages", "--multiversion", "."], env=None, timeout=300,
                        cwd=directory).stdout
    (directory / "Packages").write_text(packages)
    with gzip.open(directory / "Packages.gz", "wt") as fh:
        fh.write(packages)


def add_missing(directory: Path, debs: Iterable[Path]) -> int:
    """Copy the .debs `directory` lacks and reindex it if any was added; returns how many were added."""
    directory.mkdir(parents=True, exist_ok=True)
    added = 0
    for deb in debs:
        if not (directory / deb.name).exists():
            shutil.copy2(deb, directory / deb.name)
            added += 1
    if added or not (directory / "Packages").exists():
        index_flat(directory)
    return added


def publish(state_dir: Path, files: Iterable[Path]) -> list[str]:
    """Copy .deb files into the apt repository and .whl files into the wheelhouse; reindex apt."""
    published: list[str] = []
    debs = False
    for f in files:
        if not f.is_file():
            raise BadInput(f"{f}: no such file")
        if f.suffix == ".deb":
            dest = repo_dir(state_dir) / "apt"
            debs = True
        elif f.suffix == ".whl":
            dest = repo_dir(state_dir) / "wheels"
        else:
            raise BadInput(f"{f}: only .deb and .whl files can be published")
        shutil.copy2(f, dest / f.name)
        published.append(str(dest / f.name))
    if debs:
        reindex_apt(state_dir)
    return published


def url(sim: SimState) -> str:
    return f"http://{sim.bridge_address}:{sim.http_port}"


def ensure_server(state_dir: Path, sim: SimState) -> None:
    """Serve the repository on the bridge address only (never on the host's other interfaces)."""
    if is_ours(sim.http_pid, sim.http_pid_start):
        return
    log = open(state_dir / "http.log", "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(sim.http_port), "--bind", sim.bridge_address,
             "--directory", str(repo_dir(state_dir))],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
    finally:
        log.close()
    sim.http_pid = proc.pid
    sim.http_pid_start = process_start_time(proc.pid)
