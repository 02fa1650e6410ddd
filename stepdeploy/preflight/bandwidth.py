"""Launch the all_reduce sweep (stepdeploy/workload/nccl_bench.py) with torchrun on every node at once.

It runs as root: nothing it imports or writes may sit in a directory another user can write under a name
they can guess. Each node (this machine too, with --local) gets a fresh private directory (mktemp -d, 0700)
holding the script, torchrun starts in it with `python -I` (no working directory, PYTHONPATH or user
site-packages on sys.path: a planted /tmp/torch/ is never imported), and the directory is removed after.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import stepdeploy.workload
from stepdeploy.remote.transport import Channel, each

SCRIPT = Path(stepdeploy.workload.__file__).parent / "nccl_bench.py"
SCRIPT_NAME = "nccl_bench.py"
# The gate measures plain ring/tree all_reduce; NVLink multicast (NVLS) needs the fabric manager and IMEX
# and, on shared hosts, can take GPUs out of service: keep it off unless the caller's environment sets it.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Sweep:
    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int = 29533
    backend: str = "auto"
    sizes: str | None = None
    iters: int = 20
    warmup: int = 5
    iface: str | None = None
    timeout_s: int = 180


def command(sweep: Sweep, python: str, node_rank: int, workdir: str, inherit: dict[str, str] | None = None) -> str:
    """torchrun of the sweep, started in `workdir` (the private directory that holds the script)."""
    env = {**SAFE_ENV, **(inherit or {})}
    if sweep.iface:
        env |= {"NCCL_SOCKET_IFNAME": sweep.iface, "GLOO_SOCKET_IFNAME": sweep.iface}
    if sweep.nnodes == 1:
        rdzv = "--standalone"
    else:
        rdzv = (f"--nnodes={sweep.nnodes} --node-rank={node_rank} --master-addr={sweep.master_addr} "
                f"--master-port={sweep.master_port}")
    args = f"--backend {sweep.backend} --iters {sweep.iters} --warmup {sweep.warmup} " \
           f"--timeout-s {max(30, sweep.timeout_s // 2)}"
    if sweep.sizes:
        args += f" --sizes {shlex.quote(sweep.sizes)}"
    env["TMPDIR"] = workdir  # torchrun's own temporary files go with the private directory
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    script = shlex.quote(f"{workdir}/{SCRIPT_NAME}")
    return (f"cd -- {shlex.quote(workdir)} && env {exports} timeout -k 5 {sweep.timeout_s} {shlex.quote(python)} -I "
            f"-m torch.distributed.run {rdzv} --nproc-per-node={sweep.nproc_per_node} {script} {args}")


def parse(stdout: str) -> tuple[list[dict], dict | None]:
    rows, summary = [], None
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if data.get("summary"):
            summary = data
        elif "size_bytes" in data:
            rows.append(data)
    return rows, summary


def private_dir(target: Channel) -> str:
    """A new directory only root can enter (mktemp -d: unpredictable name, mode 0700) on the target."""
    made = target.run("umask 077 && mktemp -d /tmp/stepdeploy-nccl.XXXXXXXXXX", 15)
    path = made.stdout.strip()
    if made.rc != 0 or not path.startswith("/tmp/stepdeploy-nccl.") or "\n" in path:
        raise RuntimeError(f"mktemp -d failed: {(made.stderr or made.stdout).strip()[-200:]}")
    return path


def run(targets: Sequence[Channel], pythons: dict[str, str], sweep: Sweep, *,
        inherit: dict[str, str] | None = None) -> tuple[list[dict], dict | None, str | None]:
    """(rows, summary, error). targets[0] is rank 0 (its training address is sweep.master_addr)."""
    ranks = {t.name: i for i, t in enumerate(targets)}

    def one(t: Channel):
        workdir = private_dir(t)
        try:
            t.put(SCRIPT.read_bytes(), f"{workdir}/{SCRIPT_NAME}")
            return t.run(command(sweep, pythons[t.name], ranks[t.name], workdir, inherit), sweep.timeout_s + 15)
        finally:
            t.run(f"rm -rf -- {shlex.quote(workdir)}", 15)

    answers = each(targets, one, sweep.timeout_s + 30)
    errors = []
    for name, ans in answers.items():
        if isinstance(ans, BaseException):
            errors.append(f"{name}: {ans}")
        elif ans.rc != 0:
            tail = (ans.stderr + ans.stdout).strip().splitlines()[-3:]
            errors.append(f"{name}: torchrun exited {ans.rc}: {' | '.join(tail)[-400:]}")
    first = answers.get(targets[0].name)
    rows, summary = parse(first.stdout) if first is not None and not isinstance(first, BaseException) else ([], None)
    return rows, summary, "; ".join(errors) or None
