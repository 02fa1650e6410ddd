"""Starts this node's training ranks without torchrun (standard library only, and ckpt.py's atomic write on a failure;
shipped as files):

    python -I launch_ranks.py --nnodes N --nproc-per-node P --node-rank R --master-addr A --master-port PORT \\
        -- SCRIPT [ARG...]

It does what torchrun's static rendezvous does for our runs, without importing torch first (torchrun's own import
is about a second, paid on every start and every restart of a soak): P workers `python -u SCRIPT ARG...`, each in a
session of its own, with torchrun's environment (RANK = R x P + local rank, LOCAL_RANK, WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, ...); the rank-0 worker hosts the TCPStore at MASTER_ADDR:MASTER_PORT (init_process_group's
env://, as the Slurm executor's per-GPU tasks do). A worker's exit is seen at once (a blocking wait, not torchrun's
polling): the first to fail stops the others (SIGTERM, SIGKILL after GRACE_S) and its code is this launcher's
(128 + N for a signal N); every worker exiting 0 is 0. SIGTERM, SIGINT or SIGHUP stop the workers the same way
(exit 128 + the signal). torchrun stays the launcher of the c10d rendezvous and of torchrun's own restarts
(render/options.py).

With --status-dir (the workload's out/status, rendered by launch.sh), the launcher writes down what it saw, because
it alone saw it: before it stops the others, the first worker to fail gets `failed_first_at` (the launcher's clock
when it reaped it) and `launcher_saw` ("was killed by signal 9 (SIGKILL)", "exited 1") in its rank's status file;
after the stop, each worker it stopped gets `stopped_after_rank`. A worker's own exit record (train.py's "exited",
code and reason: more specific than a wait status) is kept; one that wrote none (SIGKILLed, crashed) gets state
"died" (a signal) or "exited", its code and the launcher's words. The controller (monitor/classify.py) blames the
earliest `failed_first_at` across nodes, so a node killed whole a moment later (srun --kill-on-bad-exit) is not
taken for the culprit. The files are replaced atomically, never left half-written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL of its workers
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
MAX_STATUS_BYTES = 65536  # a worker's own status file: the controller's probe reads no more (node_probe.py)


class Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch_ranks.py", description="start this node's training ranks (torchrun's static rendezvous)",
        epilog="example: launch_ranks.py --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr 10.0.0.1 "
               "--master-port 29500 -- train.py --config workload.json --out-dir out")
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--status-dir", help="the ranks' status files (rank<R>.json, the workload's out/status): "
                                             "what the launcher saw of the first failure and of those it stopped")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARG...]: what every rank runs")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no script to run: give it after --")
    if args.nnodes < 1 or args.nproc_per_node < 1 or not 0 <= args.node_rank < args.nnodes:
        parser.error(f"node rank {args.node_rank} of {args.nnodes} node(s), {args.nproc_per_node} per node: "
                     "need 1 or more of each and 0 <= node rank < nodes")
    if not 0 < args.master_port < 65536:
        parser.error(f"master port {args.master_port} is not a TCP port")
    return args


def global_rank(args: argparse.Namespace, local_rank: int) -> int:
    return args.node_rank * args.nproc_per_node + local_rank


def rank_env(args: argparse.Namespace, local_rank: int, base: dict[str, str]) -> dict[str, str]:
    """The environment torchrun gives a worker (torch.distributed.elastic.agent.server.local_elastic_agent)."""
    world = args.nnodes * args.nproc_per_node
    rank = global_rank(args, local_rank)
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), GROUP_RANK=str(args.node_rank), ROLE_RANK=str(rank),
               ROLE_NAME="default", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(args.nproc_per_node),
               GROUP_WORLD_SIZE=str(args.nnodes), ROLE_WORLD_SIZE=str(world), MASTER_ADDR=args.master_addr,
               MASTER_PORT=str(args.master_port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
    if args.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for more than one worker per node
    return env


def exit_code(status: int) -> int:
    """A wait status as a shell would report it: the exit code, or 128 + the signal that ended it."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _ended(status: int) -> str:
    """How a worker ended, in words monitor/diagnose.py knows ("signal 9 (SIGKILL)": the `killed` signature)."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = "?"
        return f"was killed by signal {signum} ({name})"
    return f"exited {os.waitstatus_to_exitcode(status)}"


def stop(workers: dict[int, int], grace_s: float = GRACE_S) -> dict[int, tuple[int, int]]:
    """SIGTERM to every live worker, SIGKILL to those still there after `grace_s`; reaps them all.
    Returns {pid: (local rank, wait status)} of those it reaped."""
    reaped: dict[int, tuple[int, int]] = {}
    for pid in workers:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while workers:
        for pid in list(workers):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                reaped[pid] = (workers.pop(pid), status)
        if workers and time.monotonic() >= deadline:
            for pid in workers:
                _signal(pid, signal.SIGKILL)
            deadline = float("inf")
        if workers:
            time.sleep(0.02)
    return reaped


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _on_signal(signum: int, _frame: object) -> None:
    for each in STOP_SIGNALS:  # the stop is under way: a second signal must not interrupt it
        signal.signal(each, signal.SIG_IGN)
    raise Stop(signum)


def run(args: argparse.Namespace, grace_s: float = GRACE_S) -> int:
    for each in STOP_SIGNALS:
        signal.signal(each, _on_signal)
    workers: dict[int, int] = {}  # pid -> local rank, while not reaped
    procs = []  # held until the end: a collected Popen of a live child would be reaped by subprocess, not here
    base = dict(os.environ)
    code = 0
    first: int | None = None  # the rank of the first worker to fail
    try:
        for local_rank in range(args.nproc_per_node):
            proc = subprocess.Popen([sys.executable, "-u", *args.command], env=rank_env(args, local_rank, base),
                                    start_new_session=True)
            procs.append(proc)
            workers[proc.pid] = local_rank
        while workers:
            pid, status = os.waitpid(-1, 0)
            seen = time.time()
            local_rank = workers.pop(pid, None)
            if local_rank is None:
                continue
            code = exit_code(status)
            if code:
                print(f"launch_ranks: local rank {local_rank} (pid {pid}) {_ended(status)}; stopping "
                      f"{len(workers)} other(s)", file=sys.stderr, flush=True)
                first = global_rank(args, local_rank)
                # before the stop and this launcher's exit: under srun --kill-on-bad-exit that exit gets every
                # other node killed, and their ranks must not read as the first to die
                _note(args.status_dir, first, pid, status, {"failed_first_at": seen},
                      "seen by its launcher first on its node")
                break
    except Stop as exc:
        print(f"launch_ranks: {exc}: stopping {len(workers)} worker(s)", file=sys.stderr, flush=True)
        code = 128 + exc.signum
    except OSError as exc:  # a worker could not be started
        print(f"launch_ranks: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for each in STOP_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        stopped = stop(workers, grace_s)
        if first is not None:  # written once they are reaped: a live worker may still be writing its own record
            for pid, (local_rank, status) in sorted(stopped.items(), key=lambda item: item[1][0]):
                _note(args.status_dir, global_rank(args, local_rank), pid, status, {"stopped_after_rank": first},
                      f"stopped by its launcher after rank {first} failed")
    return code


# --- what the launcher saw, in the ranks' status files ------------------------------------------------------------


def _note(status_dir: str | None, rank: int, pid: int, status: int, fields: dict[str, object], why: str) -> None:
    """Add what the launcher saw of worker `pid` (rank `rank`, wait status `status`) to its rank's status file.
    Stop signals wait until the file is replaced (a stop must not leave it half-done); a failed write is said on
    stderr and the launcher goes on (its exit matters more than its record)."""
    if status_dir is None:
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        write_record(status_dir, rank, pid, status, fields, why)
    except (OSError, ValueError) as exc:
        print(f"launch_ranks: cannot record rank {rank}'s end: {exc}", file=sys.stderr, flush=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def write_record(status_dir: str, rank: int, pid: int, status: int, fields: dict[str, object], why: str) -> None:
    """Rank `rank`'s status file (<status_dir>/rank<R>.json, the workload's metrics.RankFiles) with what the launcher
    saw of its worker `pid`, ended with wait status `status`, and `fields`. The worker's own exit record ("exited",
    its code and reason: more than a wait status says) is kept; a worker that wrote none (SIGKILLed, crashed) gets
    "died" (a signal) or "exited", its code and the launcher's words. `launcher_saw`: the wait status in words."""
    path = os.path.join(status_dir, f"rank{rank}.json")
    saw = _ended(status)
    own = own_record(path, pid)
    if own is not None and own.get("state") == "exited":
        record = own
    else:
        record = (own or {"rank": rank, "pid": pid, "node": os.environ.get("STEPDEPLOY_NODE_NAME")}) | {
            "state": "died" if os.WIFSIGNALED(status) else "exited", "code": exit_code(status),
            "reason": f"{saw}, {why}; no exit record of its own", "ended": time.time()}
    # the status file as the worker writes it (metrics.RankFiles): readers see the old record or the new, never a
    # part. Imported here, on a failure only: a start stays as light as the standard library's own (launch_cost.py)
    if __package__:  # imported as stepdeploy.workload.launch_ranks (the tests)
        from .ckpt import atomic_write_json
    else:  # the node's file, beside ckpt.py (main puts their directory on sys.path)
        from ckpt import atomic_write_json

    atomic_write_json(Path(path), record | {"launcher_saw": saw} | fields)


def own_record(path: str, pid: int) -> dict[str, object] | None:
    """The status record worker `pid` wrote itself, or None: none, unreadable, not a JSON object, longer than
    MAX_STATUS_BYTES, or an earlier start's (a soak's restart reuses the run directory, its pid is another)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_STATUS_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MAX_STATUS_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and data.get("pid") == pid else None


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    # sibling modules (ckpt.py), also under python -I; only when run as the node's file, so that importing this
    # module elsewhere leaves that process's sys.path alone
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
