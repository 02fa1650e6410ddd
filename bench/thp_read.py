"""What THP_MEM_ALLOC_ENABLE=1 (torch's CPU allocator asks for transparent huge pages, which render sets on every
node) does to a torch DCP checkpoint read, the restart's largest part (issue 20). Saves GIB of fp32 tensors with
torch DCP's FileSystemWriter into a fresh private directory (on /dev/shm where it exists), then reads them back in
fresh processes, alternately without and with the variable, into preallocated tensors on DEVICE (megatron-core's
load reads into the model's and optimizer's GPU tensors). Prints one JSON line: each read's seconds and the ratio
of the medians. torch alone: an exploration, not a product figure.

    python bench/thp_read.py [--gib 2] [--tensors 64] [--rounds 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(where: str, tensors: int, numel: int, device: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    state = {f"t{i}": torch.zeros(numel, device=device) for i in range(tensors)}
    began = time.perf_counter()
    dcp.load(state, storage_reader=dcp.FileSystemReader(where), no_dist=True)
    if device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"read_s": round(time.perf_counter() - began, 3)}))


def main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    numel = int(args.gib * 2**30 / 4 / args.tensors)
    parent = "/dev/shm" if Path("/dev/shm").is_dir() else None
    where = tempfile.mkdtemp(prefix="thp-read-", dir=parent)
    try:
        dcp.save({f"t{i}": torch.randn(numel) for i in range(args.tensors)},
                 storage_writer=dcp.FileSystemWriter(where), no_dist=True)
        reads: dict[str, list[float]] = {"default": [], "THP_MEM_ALLOC_ENABLE=1": []}
        for _ in range(args.rounds):
            for mode, extra in (("default", {}), ("THP_MEM_ALLOC_ENABLE=1", {"THP_MEM_ALLOC_ENABLE": "1"})):
                env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | extra
                out = subprocess.run([sys.executable, __file__, "--child", where, "--tensors", str(args.tensors),
                                      "--numel", str(numel), "--device", args.device],
                                     env=env, capture_output=True, text=True, check=True).stdout
                reads[mode].append(json.loads(out.strip().splitlines()[-1])["read_s"])
    finally:
        shutil.rmtree(where, ignore_errors=True)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(json.dumps({"gib": args.gib, "tensors": args.tensors, "device": args.device, "torch": torch.__version__,
                      "thp": thp.read_text().strip() if thp.exists() else None, "reads_s": reads,
                      "ratio_of_medians": round(statistics.median(reads["default"])
                                                / statistics.median(reads["THP_MEM_ALLOC_ENABLE=1"]), 2)}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.child:
        child(parsed.child, parsed.tensors, parsed.numel, parsed.device)
    else:
        main(parsed)
