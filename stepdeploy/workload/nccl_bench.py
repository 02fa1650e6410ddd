"""all_reduce bandwidth sweep, started by torchrun on every node (NCCL on GPUs, gloo on CPU nodes).

For each message size: one all_reduce checked against the known answer, `--warmup` untimed ones, then
`--iters` timed ones. The time of a size is the slowest rank's mean; algbw = bytes / time and
busbw = algbw * 2(n-1)/n, as nccl-tests defines them. Rank 0 prints one JSON line per size, then a
summary line. Self-contained (only torch): it is copied to nodes and run there, never imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

NCCL_DEFAULT_SIZES = "1M,16M,256M,1G"  # the sizes FACTS quotes for 2xH200
GLOO_DEFAULT_SIZES = "64K,1M,4M"
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMG]?)(i?B)?", text.strip(), flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 64K, 16M, 1G)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def bus_factor(world: int) -> float:
    return 2 * (world - 1) / world if world > 1 else 1.0


def measure(size_bytes: int, device: torch.device, warmup: int, iters: int) -> dict:
    world = dist.get_world_size()
    numel = max(1, size_bytes // 4)
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(buf)
    correct = bool(torch.all(buf == float(world)).item())
    for _ in range(warmup):
        dist.all_reduce(buf)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    sync()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    ok_all = torch.tensor([1 if correct else 0], device=device)
    dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)
    seconds = elapsed.item()
    algbw = numel * 4 / seconds / 1e9
    return {"size_bytes": numel * 4, "time_us": round(seconds * 1e6, 1), "algbw_gbps": round(algbw, 3),
            "busbw_gbps": round(algbw * bus_factor(world), 3), "correct": bool(ok_all.item())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: nccl when CUDA is available, else gloo")
    parser.add_argument("--sizes", default=None, help=f"comma-separated sizes (nccl default {NCCL_DEFAULT_SIZES}, "
                                                      f"gloo default {GLOO_DEFAULT_SIZES})")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="process-group timeout (gloo's default: 30 min)")
    args = parser.parse_args(argv)

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    sizes = [parse_size(s) for s in (args.sizes or (NCCL_DEFAULT_SIZES if backend == "nccl"
                                                    else GLOO_DEFAULT_SIZES)).split(",")]
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    started = time.monotonic()
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, socket.gethostname())
    all_correct = True
    for size in sizes:
        row = measure(size, device, args.warmup, args.iters)
        all_correct &= row["correct"]
        if rank == 0:
            print(json.dumps({"backend": backend, "world": world, **row}), flush=True)
    if rank == 0:
        print(json.dumps({"summary": True, "backend": backend, "world": world, "hosts": sorted(set(hosts)),
                          "torch": torch.__version__, "nccl": _nccl_version(backend), "correct": all_correct,
                          "seconds": round(time.monotonic() - started, 3)}), flush=True)
    dist.destroy_process_group()
    return 0 if all_correct else 1


def _nccl_version(backend: str) -> str | None:
    if backend != "nccl":
        return None
    try:
        return ".".join(str(p) for p in torch.cuda.nccl.version())
    except Exception:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
