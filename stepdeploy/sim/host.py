"""Side effects on the host: running commands and checking the prerequisites the simulated cluster needs."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from stepdeploy.errors import MissingPrerequisite, StepdeployError

# Host commands and the Debian package that provides each.
HOST_COMMANDS = {
    "ip": "iproute2",
    "unshare": "util-linux",
    "mount": "mount",
    "umount": "mount",
    "chroot": "coreutils",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "dpkg-scanpackages": "dpkg-dev",
}
BUILD_COMMANDS = {"debootstrap": "debootstrap"}

# Clean environment for anything run inside a node root: host PIP_*/VIRTUAL_ENV etc. must not leak in.
NODE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}


class HostCommandError(StepdeployError):
    """A host command failed; the message carries the command and the tail of its stderr."""


def run(argv: Sequence[str], *, check: bool = True, env: dict[str, str] | None = None,
        input_text: str | None = None, timeout: float | None = 600,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a host command without a shell (argv list: nothing is ever re-parsed by a shell)."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=env, input=input_text,
                          timeout=timeout, check=False, cwd=cwd)
    if check and proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise HostCommandError(f"`{' '.join(argv)}` exited {proc.returncode}: {' | '.join(tail)}")
    return proc


def missing_prerequisites(*, need_build: bool) -> list[str]:
    """Everything this machine lacks for the simulated cluster, each as 'what (how to get it)'."""
    missing: list[str] = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces, mounts and chroot need it: run as root)")
    wanted = dict(HOST_COMMANDS)
    if need_build:
        wanted.update(BUILD_COMMANDS)
    for cmd, package in wanted.items():
        if shutil.which(cmd) is None:
            missing.append(f"{cmd} (apt-get install {package})")
    if not _kernel_has_overlayfs():
        missing.append("overlayfs in the kernel (modprobe overlay)")
    return missing


def require_prerequisites(*, need_build: bool) -> None:
    missing = missing_prerequisites(need_build=need_build)
    if missing:
        raise MissingPrerequisite(
            "the simulated cluster needs: " + "; ".join(missing),
            hint="apt-get install -y debootstrap dpkg-dev iproute2 openssh-client, then run as root",
        )


def _kernel_has_overlayfs() -> bool:
    try:
        with open("/proc/filesystems") as fh:
            if any(line.split()[-1] == "overlay" for line in fh if line.strip()):
                return True
    except OSError:
        return False
    return shutil.which("modprobe") is not None and run(["modprobe", "overlay"], check=False).returncode == 0


def apt_mirror() -> str:
    """The Debian mirror this machine's own apt uses (debootstrap must use the same one to reach it)."""
    for path in ("/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"):
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
            if line.startswith("deb ") and "security" not in line:
                parts = [p for p in line.split()[1:] if not p.startswith("[")]
                if parts and "debian" in parts[0]:
                    return parts[0]
    return "http://deb.debian.org/debian"
