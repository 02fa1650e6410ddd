"""The cached node base image: a debootstrap'ed Debian root plus a venv with torch (CPU).

The cache directory's name carries a hash of the recipe, so a changed recipe is a new directory and is
built automatically; a build happens in a temporary directory and is renamed into place only when
complete, so a killed build never leaves a half base behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stepdeploy.sim import host

# Bump when the build steps below change in a way the recipe fields do not capture.
BUILD_STEPS_VERSION = 1

NODE_VENV = "/opt/stepdeploy/venv"


@dataclass(frozen=True)
class BaseRecipe:
    suite: str = "bookworm"
    variant: str = "minbase"
    packages: tuple[str, ...] = (
        "python3", "python3-apt", "python3-venv", "python3-packaging", "openssh-server", "sudo",
        "iproute2", "procps", "ca-certificates", "tini", "iputils-ping",
    )
    # Installed offline into NODE_VENV from the controller's wheelhouse (torch's CPU build).
    node_wheels: tuple[str, ...] = ("torch==2.13.0", "numpy>=1.26,<3")
    python_tag: str = "3.11"  # bookworm's python3
    arch: str = field(default_factory=platform.machine)
    steps_version: int = BUILD_STEPS_VERSION

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("STEPDEPLOY_CACHE_DIR", "/var/cache/stepdeploy"))


def base_dir(recipe: BaseRecipe) -> Path:
    return cache_root() / f"base-{recipe.digest()}"


def wheelhouse_dir() -> Path:
    return cache_root() / "wheelhouse"


def ensure_base(recipe: BaseRecipe, progress: Callable[[str], None] = lambda _m: None) -> Path:
    """Return the cached base for `recipe`, building it first if it is not there."""
    target = base_dir(recipe)
    if (target / ".stepdeploy-base.json").exists():
        return target
    host.require_prerequisites(need_build=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        root = work / "root"
        progress(f"debootstrap {recipe.suite} ({len(recipe.packages)} packages) into the base cache")
        _debootstrap(recipe, root)
        _scrub(root)
        if recipe.node_wheels:
            progress(f"installing {', '.join(recipe.node_wheels)} into the node venv (offline, wheelhouse)")
            download_wheels(recipe.node_wheels, recipe)
            _install_node_venv(root, recipe)
        (root / ".stepdeploy-base.json").write_text(json.dumps(asdict(recipe), indent=2) + "\n")
        if target.exists():  # a concurrent build won the race; keep theirs
            return target
        root.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _prune_old_bases(keep=target)
    return target


def _debootstrap(recipe: BaseRecipe, root: Path) -> None:
    host.run([
        "debootstrap", f"--variant={recipe.variant}", f"--include={','.join(recipe.packages)}",
        recipe.suite, str(root), host.apt_mirror(),
    ], timeout=1800)


def _scrub(root: Path) -> None:
    """Make the base anonymous: no host keys (each node gets its own), no resolver, no apt caches."""
    host.run(["chroot", str(root), "apt-get", "clean"], env=host.NODE_ENV)
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("")
    shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
    (root / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    # sshd is started by the node launcher, never by an init system.
    (root / "usr/sbin/policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
    (root / "usr/sbin/policy-rc.d").chmod(0o755)


def download_wheels(specs: tuple[str, ...], recipe: BaseRecipe) -> Path:
    """Fill the controller's wheelhouse with `specs` and their dependencies for the nodes' Python."""
    dest = wheelhouse_dir()
    dest.mkdir(parents=True, exist_ok=True)
    host.run([
        sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
        "--only-binary=:all:", "--python-version", recipe.python_tag, "--implementation", "cp",
        *[a for plat in _platform_tags(recipe.arch) for a in ("--platform", plat)],
        "-d", str(dest), *specs,
    ], timeout=1800)
    return dest


def _platform_tags(arch: str) -> list[str]:
    return [f"manylinux_2_{n}_{arch}" for n in (36, 35, 34, 31, 28, 27, 24, 17)] + [f"manylinux2014_{arch}"]


def _install_node_venv(root: Path, recipe: BaseRecipe) -> None:
    """Create NODE_VENV inside the base and install the wheels offline, with the wheelhouse bind-mounted."""
    mnt = root / "mnt/wheelhouse"
    mnt.mkdir(parents=True, exist_ok=True)
    q = shlex.quote
    script = (
        f"mount --bind {q(str(wheelhouse_dir()))} {q(str(mnt))} && mount -t proc proc {q(str(root / 'proc'))}"
        f" && chroot {q(str(root))} /usr/bin/python3 -m venv {NODE_VENV}"
        f" && chroot {q(str(root))} {NODE_VENV}/bin/pip install --quiet --no-index --no-cache-dir"
        f" --find-links /mnt/wheelhouse {' '.join(q(w) for w in recipe.node_wheels)}"
    )
    # A private mount namespace: the bind and proc mounts vanish with the process, even if it is killed.
    host.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
             env=host.NODE_ENV, timeout=1800)
    mnt.rmdir()


def _prune_old_bases(keep: Path) -> None:
    """Delete bases of other recipes (each is ~1 GB); nodes of a running cluster keep theirs mounted."""
    for other in keep.parent.glob("base-*"):
        if other != keep and other.is_dir() and not _in_use(other):
            shutil.rmtree(other, ignore_errors=True)


def _in_use(path: Path) -> bool:
    try:
        return str(path) in Path("/proc/self/mountinfo").read_text()
    except OSError:
        return True
