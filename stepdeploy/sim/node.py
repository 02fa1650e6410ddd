"""One simulated node: its overlay root, its identity files (hostname, host key, hosts, apt/pip sources)
and its process tree (`ip netns exec` -> `unshare` -> tini -> sshd)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from stepdeploy.sim import host
from stepdeploy.sim.state import NodeState, SimState, is_ours, process_start_time

SSHD_CONFIG = """\
# Written by stepdeploy's simulated cluster.
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
MaxStartups 200
MaxSessions 64
"""

# Run inside the node's fresh mount/UTS/PID namespaces, before chroot: a minimal /dev, /proc, /sys,
# /dev/shm and /run; then tini (reaps orphans, sshd as PID 1 would not) runs sshd in the foreground.
_NODE_INIT = r"""
set -eu
R=$1; H=$2
hostname "$H"
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
mount -t tmpfs -o mode=755,size=16m tmpfs "$R/dev"
mknod -m 666 "$R/dev/null" c 1 3
mknod -m 666 "$R/dev/zero" c 1 5
mknod -m 666 "$R/dev/full" c 1 7
mknod -m 666 "$R/dev/random" c 1 8
mknod -m 666 "$R/dev/urandom" c 1 9
mknod -m 666 "$R/dev/tty" c 5 0
ln -s /proc/self/fd "$R/dev/fd"; ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
mkdir "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=1777,size=2g tmpfs "$R/dev/shm"
mount -t tmpfs -o mode=755 tmpfs "$R/run"
mkdir -p "$R/run/sshd"
exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
  chroot "$R" /usr/bin/tini -s -- /usr/sbin/sshd -D -e
"""


def mount_root(base: Path, node_dir: Path) -> Path:
    root = node_dir / "root"
    for sub in ("upper", "work", "root"):
        (node_dir / sub).mkdir(parents=True, exist_ok=True)
    if not is_mounted(root):
        opts = f"lowerdir={base},upperdir={node_dir / 'upper'},workdir={node_dir / 'work'}"
        host.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(root)])
    return root


def is_mounted(path: Path) -> bool:
    target = str(path)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    return any(line.split()[4] == target for line in lines)


def unmount_root(root: Path) -> None:
    for _ in range(20):
        if not is_mounted(root):
            return
        if host.run(["umount", str(root)], check=False).returncode != 0:
            time.sleep(0.1)
    host.run(["umount", "--lazy", str(root)], check=False)


def configure(root: Path, node: NodeState, sim: SimState, client_pubkey: str) -> str:
    """Write the node's identity into its root; returns its host public key line (type and key)."""
    (root / "etc/hostname").write_text(node.name + "\n")
    write_hosts(root, sim)
    key = root / "etc/ssh/ssh_host_ed25519_key"
    if not key.exists():
        host.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{node.name}", "-f", str(key)])
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/ssh/sshd_config.d/stepdeploy.conf").write_text(SSHD_CONFIG)
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    auth = ssh_dir / "authorized_keys"
    auth.write_text(client_pubkey.strip() + "\n")
    auth.chmod(0o600)
    repo = f"http://{sim.bridge_address}:{sim.http_port}"
    (root / "etc/apt/sources.list").write_text(f"deb [trusted=yes] {repo}/apt ./\n")
    for extra in (root / "etc/apt/sources.list.d").glob("*"):
        extra.unlink()
    (root / "etc/pip.conf").write_text(f"[global]\nno-index = true\nfind-links = {repo}/wheels/\n")
    key_type, key_body = key.with_suffix(".pub").read_text().split()[:2]
    return f"{key_type} {key_body}"


def write_hosts(root: Path, sim: SimState) -> None:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{sim.bridge_address}\tcontroller"]
    lines += [f"{n.address}\t{n.name}" for n in sim.nodes]
    (root / "etc/hosts").write_text("\n".join(lines) + "\n")


def start(node: NodeState, log_path: Path) -> None:
    """Start the node's process tree; records the PID (and its start time) in `node`."""
    argv = ["ip", "netns", "exec", node.netns, "unshare", "--mount", "--uts", "--pid", "--fork",
            "--kill-child", "--propagation", "private", "sh", "-c", _NODE_INIT, "node-init",
            node.root, node.name]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, env=host.NODE_ENV)
    node.pid = proc.pid
    node.pid_start = process_start_time(proc.pid)


def is_running(node: NodeState) -> bool:
    return is_ours(node.pid, node.pid_start)


def wait_ssh(address: str, timeout: float = 30.0) -> bool:
    """True once the node's sshd answers with its banner."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ssh_banner(address):
            return True
        time.sleep(0.05)
    return False


def ssh_banner(address: str, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((address, 22), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(64).startswith(b"SSH-2.0")
    except OSError:
        return False


def stop(node: NodeState, timeout: float = 10.0) -> None:
    """Kill the node's process tree: SIGKILL to `unshare` (which, with --fork, ignores SIGTERM) makes the
    kernel SIGKILL its child, the namespace's PID 1, which takes every process of the node with it."""
    if node.pid is None:
        return
    kill_process(node.pid, node.pid_start, timeout=timeout, sig=signal.SIGKILL)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, ProcessLookupError):
        os.waitpid(pid, os.WNOHANG)

def kill_process(pid: int, start: int | None, timeout: float = 5.0, sig: int = signal.SIGTERM) -> None:
    """Signal a process we started (identity checked by start time), then SIGKILL if it lingers."""
    if not is_ours(pid, start):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and is_ours(pid, start):
        _reap(pid)
        time.sleep(0.02)
    if is_ours(pid, start):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _reap(pid)


def mounts_under(directory: Path) -> list[str]:
    prefix = str(directory).rstrip("/") + "/"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    return [line.split()[4] for line in lines if line.split()[4].startswith(prefix)]


def processes_rooted_under(directory: Path) -> list[int]:
    """PIDs whose root directory lies in `directory` (a node's processes are chrooted into its root)."""
    prefix = str(directory).rstrip("/") + "/"
    pids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            root = os.readlink(entry / "root")
        except OSError:
            continue
        if root.startswith(prefix):
            pids.append(int(entry.name))
    return pids
