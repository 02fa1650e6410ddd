"""Starts this node's training ranks without torchrun (standard library only; shipped as a file):

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
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL of its workers
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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


def rank_env(args: argparse.Namespace, local_rank: int, base: dict[str, str]) -> dict[str, str]:
    """The environment torchrun gives a worker (torch.distributed.elastic.agent.server.local_elastic_agent)."""
    world = args.nnodes * args.nproc_per_node
    rank = args.node_rank * args.nproc_per_node + local_rank
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


def stop(workers: dict[int, int], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every live worker, SIGKILL to those still there after `grace_s`; reaps them all."""
    for pid in workers:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while workers:
        for pid in list(workers):
            done, _status = os.waitpid(pid, os.WNOHANG)
            if done:
                del workers[pid]
        if workers and time.monotonic() >= deadline:
            for pid in workers:
                _signal(pid, signal.SIGKILL)
            deadline = float("inf")
        if workers:
            time.sleep(0.02)


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
    try:
        for local_rank in range(args.nproc_per_node):
            proc = subprocess.Popen([sys.executable, "-u", *args.command], env=rank_env(args, local_rank, base),
                                    start_new_session=True)
            procs.append(proc)
            workers[proc.pid] = local_rank
        while workers:
            pid, status = os.waitpid(-1, 0)
            local_rank = workers.pop(pid, None)
            if local_rank is None:
                continue
            code = exit_code(status)
            if code:
                print(f"launch_ranks: local rank {local_rank} (pid {pid}) {_ended(status)}; stopping "
                      f"{len(workers)} other(s)", file=sys.stderr, flush=True)
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
        stop(workers, grace_s)
    return code


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
