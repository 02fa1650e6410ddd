"""Stand-in NVIDIA packages for nodes without a GPU or a route to NVIDIA's repositories.

Each stand-in carries the name and version of the package NVIDIA's CUDA repository ships (nvidia-driver
550.54.15-1, cuda-toolkit-12-3 12.3.2-1, libnccl2 2.19.3-1+cuda12.3, ...) but installs only marker files:
no kernel module, no libraries. They let the roles' repository setup, version pins, holds, handlers and
idempotence run for real with apt on the simulated cluster. They are served from their own flat apt
repository (`<state>/repo/nvidia`, i.e. http://BRIDGE:PORT/nvidia ./) so the roles must add that
repository, exactly as they add NVIDIA's on a real node. Built with dpkg-deb, cached per version set under
/var/cache/stepdeploy/standins/.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from stepdeploy.sim import base, host
from stepdeploy.sim.repo import add_missing

MARKER = "STEPDEPLOY-STANDIN"
# Bump when what a stand-in contains changes (the cache is keyed by it).
BUILD_VERSION = 1
# The versions of the profiles the simulated cluster provisions: `sim-standin` and the seed's `seed-2024`
# (same driver, CUDA and NCCL).
DEFAULT_STACKS: tuple[tuple[str, str, str], ...] = (("550.54.15", "12.3", "2.19.3"),)


@dataclass(frozen=True)
class Standin:
    name: str
    version: str
    files: dict[str, str] = field(default_factory=dict)  # path on the node -> content
    depends: tuple[str, ...] = ()
    executables: tuple[str, ...] = ()

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version}_{architecture()}.deb"


def architecture() -> str:
    """The Debian architecture of this machine (the simulated nodes share it)."""
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()


def cuda_full_version(cuda: str) -> str:
    """The package version NVIDIA's repository carries for a CUDA `major.minor` (the latest update)."""
    return {"12.3": "12.3.2-1", "12.8": "12.8.1-1", "13.0": "13.0.2-1"}.get(cuda, f"{cuda}.0-1")


def nccl_package_version(nccl: str, cuda: str) -> str:
    return f"{nccl}-1+cuda{cuda}"


def _doc(name: str, version: str) -> dict[str, str]:
    return {f"/usr/share/doc/{name}/{MARKER}": f"{name} {version}: stand-in built by stepdeploy; "
                                                 "it carries NVIDIA's package name and version only.\n"}


def driver_standins(driver: str) -> list[Standin]:
    """Debian names of NVIDIA's driver packages (the roles' vars/Debian.yml); version <driver>-1."""
    version = f"{driver}-1"
    branch = driver.split(".")[0]
    names = ("nvidia-driver", "nvidia-kernel-dkms", "nvidia-kernel-open-dkms", "nvidia-persistenced")
    pkgs = [Standin(n, version, _doc(n, version)) for n in names]
    pkgs.append(Standin(f"cuda-drivers-{branch}", version, _doc(f"cuda-drivers-{branch}", version),
                        depends=(f"nvidia-driver (= {version})",)))
    return pkgs


def cuda_standins(cuda: str) -> list[Standin]:
    major, minor = cuda.split(".")[:2]
    name = f"cuda-toolkit-{major}-{minor}"
    version = cuda_full_version(cuda)
    prefix = f"/usr/local/cuda-{major}.{minor}"
    nvcc = (f"#!/bin/sh\n# {MARKER}: prints what NVIDIA's nvcc {version} prints; compiles nothing.\n"
            "echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
            f"echo 'Cuda compilation tools, release {major}.{minor}, V{version.split('-')[0]}'\n")
    files = {f"{prefix}/bin/nvcc": nvcc,
             f"{prefix}/version.json": f'{{"cuda": {{"name": "CUDA SDK", "version": "{version}"}}}}\n',
             f"{prefix}/lib64/{MARKER}": "no libraries: stand-in\n", **_doc(name, version)}
    return [Standin(name, version, files, executables=(f"{prefix}/bin/nvcc",))]


def nccl_standins(nccl: str, cuda: str) -> list[Standin]:
    version = nccl_package_version(nccl, cuda)
    major, minor, patch = [*nccl.split("."), "0", "0"][:3]
    header = (f"/* {MARKER}: version defines of NCCL {nccl} only */\n"
              f"#define NCCL_MAJOR {major}\n#define NCCL_MINOR {minor}\n#define NCCL_PATCH {patch}\n")
    return [Standin("libnccl2", version, _doc("libnccl2", version)),
            Standin("libnccl-dev", version, {"/usr/include/nccl.h": header, **_doc("libnccl-dev", version)},
                    depends=(f"libnccl2 (= {version})",))]


def stack_standins(driver: str | None, cuda: str | None, nccl: str | None) -> list[Standin]:
    pkgs: list[Standin] = []
    if driver:
        pkgs += driver_standins(driver)
    if cuda:
        pkgs += cuda_standins(cuda)
    if nccl and cuda:
        pkgs += nccl_standins(nccl, cuda)
    return pkgs


def control_text(pkg: Standin, arch: str) -> str:
    lines = [f"Package: {pkg.name}", f"Version: {pkg.version}", f"Architecture: {arch}",
             "Maintainer: stepdeploy <stepdeploy@localhost>", "Section: non-free/misc", "Priority: optional"]
    if pkg.depends:
        lines.append(f"Depends: {', '.join(pkg.depends)}")
    lines.append(f"Description: {MARKER} for {pkg.name} {pkg.version}\n"
                 " Stand-in built by stepdeploy for the simulated cluster: NVIDIA's package name and\n"
                 " version, marker files only (no driver, no libraries).")
    return "\n".join(lines) + "\n"


def build(pkg: Standin, dest: Path) -> Path:
    """Build one stand-in .deb into `dest` with dpkg-deb (skipped when already built)."""
    arch = architecture()
    out = dest / pkg.filename
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(prefix="standin-") as tmp:
        tree = Path(tmp) / "pkg"
        (tree / "DEBIAN").mkdir(parents=True)
        (tree / "DEBIAN/control").write_text(control_text(pkg, arch))
        for path, content in pkg.files.items():
            target = tree / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
            target.chmod(0o755 if path in pkg.executables else 0o644)
        partial = Path(tmp) / out.name
        host.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(partial)])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.move(str(partial), out)
    return out


def build_all(stacks: tuple[tuple[str, str, str], ...] = DEFAULT_STACKS, dest: Path | None = None) -> list[Path]:
    """Build (or reuse) the stand-ins of every (driver, cuda, nccl) stack; the cache directory carries
    BUILD_VERSION, so changed contents are rebuilt rather than reused."""
    dest = dest or base.cache_root() / f"standins-v{BUILD_VERSION}"
    pkgs = {p.filename: p for stack in stacks for p in stack_standins(*stack)}
    return [build(p, dest) for p in pkgs.values()]


def nvidia_repo_dir(state_dir: Path) -> Path:
    return state_dir / "repo" / "nvidia"


def publish(state_dir: Path, debs: list[Path]) -> Path:
    """Copy stand-ins into the cluster's NVIDIA stand-in repository and index it; returns its directory.
    The repository server serves `<state>/repo`, so nodes see it at http://BRIDGE:PORT/nvidia ./"""
    repo = nvidia_repo_dir(state_dir)
    add_missing(repo, debs)
    return repo
