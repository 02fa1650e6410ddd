"""torch's gloo backend, coalesced all-gather with several in flight: the heap-corruption repro behind the CPU
ParamGather test's shim (tests/unit/workload/megatron_cpu_param_gather.py, uncoalesced_collectives).

Each run spawns 4 gloo ranks on this machine (or 1: --ranks 1). Every round, each rank issues 24 in-place
async all-gathers as megatron-core issues a bucket's param gather (`all_gather_into_tensor` of a buffer from a
view of its own shard), with 4 ranks 16 over all of them and 8 over a pair, then waits for them all. Modes:

- coalesced: each gather inside `_coalescing_manager(async_ops=True)`, as megatron does; all 24 in flight;
- one-at-a-time: the same, but each waited for before the next is issued;
- plain: each a plain async `all_gather_into_tensor`; all 24 in flight;
- rs-coalesced: megatron's grad reduce-scatter the same way (coalesced, all in flight).

A run that ends in a signal (SIGABRT from glibc's "malloc(): unaligned tcache chunk detected", or SIGSEGV)
counts as a crash. Prints one line per mode: runs, crashes, seconds.

    python bench/gloo_coalesced_allgather.py [--runs 4] [--rounds 300] [--ranks 4]
        [--modes coalesced,one-at-a-time,plain]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

MODES = ("coalesced", "one-at-a-time", "plain", "rs-coalesced")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, ranks: int, rounds: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])] if ranks == 4 else []
    sizes = torch.randint(500, 6000, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    buffers = []
    for i, n in enumerate(sizes):
        group, members = (dist.group.WORLD, ranks) if i % 3 or not pairs else (pairs[rank % 2], 2)
        buffers.append((torch.zeros(n * members), group, members))
    for r in range(rounds):
        handles = []
        for buffer, group, members in buffers:
            shard = buffer.view(members, -1)[dist.get_rank(group)]
            shard.fill_(r + rank)
            if mode == "plain":
                handles.append(dist.all_gather_into_tensor(buffer, shard, group=group, async_op=True))
                continue
            with _coalescing_manager(group, async_ops=True) as cm:
                if mode == "rs-coalesced":
                    dist.reduce_scatter_tensor(shard, buffer, group=group, async_op=True)
                else:
                    dist.all_gather_into_tensor(buffer, shard, group=group, async_op=True)
            handles.append(cm)
            if mode == "one-at-a-time":
                cm.wait()
        for handle in handles:
            handle.wait()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--ranks", type=int, choices=(1, 4), default=4)
    parser.add_argument("--modes", default=",".join(MODES[:3]), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--rank-run", nargs=2, metavar=("ROUNDS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        rounds, mode = int(args.rank_run[0]), args.rank_run[1]
        torch.multiprocessing.spawn(rank_main, args=(free_port(), args.ranks, rounds, mode), nprocs=args.ranks)
        return 0
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    print(f"torch {torch.__version__}, {args.ranks} rank(s), {args.rounds} rounds x 24 collectives per run")
    for mode in modes:
        crashes, start = 0, time.monotonic()
        for _ in range(args.runs):
            proc = subprocess.run([sys.executable, __file__, "--ranks", str(args.ranks), "--rank-run",
                                   str(args.rounds), mode],
                                  capture_output=True, text=True, check=False)
            signalled = proc.returncode != 0 and "terminated with signal" in proc.stderr
            if proc.returncode != 0 and not signalled:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            crashes += signalled
        print(f"{mode:14} runs {args.runs}  crashed {crashes}  {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
