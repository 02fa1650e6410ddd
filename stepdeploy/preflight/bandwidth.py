"""Launch the all_reduce sweep (stepdeploy/workload/nccl_bench.py) with torchrun on every node at once."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import stepdeploy.workload
from stepdeploy.preflight.collect import Target, in_parallel

SCRIPT = Path(stepdeploy.workload.__file__).parent / "nccl_bench.py"
REMOTE_SCRIPT = "/tmp/stepdeploy-nccl_bench.py"
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


def command(sweep: Sweep, python: str, node_rank: int, script: str, inherit: dict[str, str] | None = None) -> str:
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
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (f"cd /tmp && env {exports} timeout -k 5 {sweep.timeout_s} {shlex.quote(python)} -m torch.distributed.run "
            f"{rdzv} --nproc-per-node={sweep.nproc_per_node} {script} {args}")


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


def run(targets: Sequence[Target], pythons: dict[str, str], sweep: Sweep, *, local: bool = False,
        inherit: dict[str, str] | None = None) -> tuple[list[dict], dict | None, str | None]:
    """(rows, summary, error). targets[0] is rank 0 (its training address is sweep.master_addr)."""
    script = str(SCRIPT) if local else REMOTE_SCRIPT
    ranks = {t.name: i for i, t in enumerate(targets)}

    def one(t):
        if not local:
            t.put(SCRIPT, REMOTE_SCRIPT)
        return t.run(command(sweep, pythons[t.name], ranks[t.name], script, inherit), sweep.timeout_s + 15)

    answers = in_parallel(targets, one, sweep.timeout_s + 30)
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
