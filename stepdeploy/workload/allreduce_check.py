"""Cross-node sanity check, started by torchrun on every node: one all_reduce with a known answer.

Each rank contributes rank + 1; the sum must be world * (world + 1) / 2 on every rank. Prints one JSON
line per rank. The process-group timeout is explicit (gloo's default is 30 minutes, far too long to
notice a partitioned node).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--timeout-s", type=float, default=30.0, help="process-group timeout in seconds")
    args = parser.parse_args()

    started = time.monotonic()
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else "cpu"
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    result = {
        "rank": rank, "world": world, "host": socket.gethostname(), "sum": value.item(),
        "expected": expected, "ok": value.item() == expected,
        "seconds": round(time.monotonic() - started, 3),
    }
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
