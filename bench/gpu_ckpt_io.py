"""Exploration on one GPU (not a product figure): where a restart's checkpoint read and a first save's host copy
spend their time, with torch alone (issues 20, 21; docs/benchmarks-log.md).

- read: a torch.distributed.checkpoint directory of about the dense proxy's size (10 GiB of fp32/bf16 tensors, the
  size mix of its save), written to memory (/dev/shm, as the GPU box's run directories are), read back into GPU
  tensors by torch's FileSystemReader and by ParallelReader (bench/threaded_reader.py) with 8 threads, into device
  and into host tensors; host-to-device copies from pageable and from pinned memory;
- pin: the first device-to-host copy of those tensors into page-locked memory (torch's caching host allocator,
  as megatron-core's save makes it), with the allocator's defaults and with `pinned_use_cuda_host_register` and 8
  register threads; and a GPU loop's step time while another thread page-locks the same bytes (the stall the
  save's head start caused on the H200); and how long a fork of the process takes before and after (megatron-core
  forks its writer per save).

    python bench/gpu_ckpt_io.py --out /tmp/io.json [--gib 10]      # both parts
    PYTORCH_CUDA_ALLOC_CONF=... python bench/gpu_ckpt_io.py --out /tmp/x --pin-only   # one allocator setting
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from threaded_reader import ParallelReader  # bench/, beside this script


def sizes(gib: float) -> list[tuple[int, str]]:
    """(elements, dtype) of a dense proxy-like save: per layer 4 weights of hidden^2-ish and 3 FFN ones, each saved
    as bf16 weights plus fp32 main, exp_avg, exp_avg_sq; scaled to `gib`."""
    hidden, ffn = 2048, 5632
    layer = [hidden * hidden * 3, hidden * hidden, hidden * ffn * 2, ffn * hidden, hidden, hidden]
    out: list[tuple[int, str]] = []
    while sum(n * (2 if d == "bf16" else 4) for n, d in out) < gib * 2**30:
        for n in layer:
            out += [(n, "bf16"), (n, "fp32"), (n, "fp32"), (n, "fp32")]
    return out


def tensors(spec: list[tuple[int, str]], device: str) -> dict:
    import torch
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}
    return {f"t{i}": torch.randn(n, dtype=dtype[d], device=device) for i, (n, d) in enumerate(spec)}


def read_bench(gib: float, where: Path) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    spec = sizes(gib)
    state = tensors(spec, "cuda")
    total = sum(t.numel() * t.element_size() for t in state.values())
    shutil.rmtree(where, ignore_errors=True)
    began = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(str(where), thread_count=2), no_dist=True)
    result: dict = {"bytes": total, "tensors": len(state), "save_s": round(time.perf_counter() - began, 3), "read": []}
    expect = {k: v.float().sum().item() for k, v in list(state.items())[:8]}
    for threads in (1, 8, 1, 8):
        target = {k: torch.empty_like(v) for k, v in state.items()}
        torch.cuda.synchronize()
        began = time.perf_counter()
        reader = FileSystemReader(str(where)) if threads == 1 else ParallelReader(str(where), threads)
        dcp.load(target, storage_reader=reader, no_dist=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        same = all(abs(target[k].float().sum().item() - v) < 1e-3 * max(1.0, abs(v)) for k, v in expect.items())
        result["read"].append({"threads": threads, "s": round(seconds, 3), "GB/s": round(total / seconds / 1e9, 2),
                               "same": same})
        print(f"read {threads:>2} thread(s): {seconds:6.2f} s  {total / seconds / 1e9:5.2f} GB/s  same={same}",
              flush=True)
        del target
    for threads in (1, 8):  # the same reads into host tensors: no device copy
        target = {k: torch.empty_like(v, device="cpu") for k, v in state.items()}
        began = time.perf_counter()
        reader = FileSystemReader(str(where)) if threads == 1 else ParallelReader(str(where), threads)
        dcp.load(target, storage_reader=reader, no_dist=True)
        seconds = time.perf_counter() - began
        result["read"].append({"threads": threads, "into": "cpu", "s": round(seconds, 3)})
        print(f"read {threads:>2} thread(s) into host tensors: {seconds:6.2f} s", flush=True)
    host = [v.to("cpu") for v in state.values()]
    for kind, pool in (("pageable", 1), ("pageable", 8), ("pinned", 1)):
        source = [h.pin_memory() for h in host] if kind == "pinned" else host
        torch.cuda.synchronize()
        began = time.perf_counter()
        with ThreadPoolExecutor(pool) as run:
            list(run.map(lambda pair: pair[0].copy_(pair[1]), zip(state.values(), source, strict=True)))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        result[f"h2d_{kind}_{pool}"] = round(seconds, 3)
        print(f"host-to-device, {kind}, {pool} thread(s): {seconds:6.2f} s  {total / seconds / 1e9:5.2f} GB/s",
              flush=True)
    shutil.rmtree(where, ignore_errors=True)
    return result


def fork_seconds() -> float:
    """How long a fork of this process takes (megatron-core's writer is a process forked per save); the child exits."""
    began = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    forked = time.perf_counter() - began
    os.waitpid(pid, 0)
    return round(forked, 3)


def pin_bench(gib: float) -> dict:
    """In this process (its PYTORCH_CUDA_ALLOC_CONF): the first and a second host copy; then a GPU loop's steps
    while a thread page-locks fresh blocks of the same sizes."""
    import torch
    spec = sizes(gib)
    state = tensors(spec, "cuda")
    out: dict = {"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "fork_before_s": fork_seconds()}
    for name in ("first_copy_s", "second_copy_s"):
        torch.cuda.synchronize()
        began = time.perf_counter()
        host = [t.to("cpu", non_blocking=True) for t in state.values()]
        torch.cuda.synchronize()
        out[name] = round(time.perf_counter() - began, 3)
        del host
    out["fork_after_s"] = fork_seconds()  # the freed blocks stay page-locked in the allocator's cache
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def step() -> float:
        began = time.perf_counter()
        for _ in range(60):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - began

    base = [step() for _ in range(5)]
    pinned: list = []

    def pin() -> None:  # blocks of other sizes than the cached ones: fresh cudaHostAlloc / register calls
        pinned.extend(torch.empty(n * 4 + 4096, dtype=torch.uint8, pin_memory=True) for n, _ in spec)

    worker = threading.Thread(target=pin)
    began = time.perf_counter()
    worker.start()
    during = []
    while worker.is_alive():
        during.append(step())
    out.update(pin_thread_s=round(time.perf_counter() - began, 3), step_s=round(statistics.median(base), 4),
               steps_during_pin=len(during), max_step_during_pin_s=round(max(during, default=0.0), 3),
               sum_steps_during_pin_s=round(sum(during), 3))
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gib", type=float, default=10.0)
    parser.add_argument("--pin-only", action="store_true")
    args = parser.parse_args()
    if args.pin_only:
        pin_bench(args.gib)
        return
    report: dict = {"read": read_bench(args.gib, Path("/dev/shm/stepdeploy-ckpt-io")), "pin": []}
    base = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for conf in (base, base + ",pinned_use_cuda_host_register:True,pinned_num_register_threads:8"):
        done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--gib", str(args.gib),
                               "--pin-only"], env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf},
                              capture_output=True, text=True, timeout=300, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        report["pin"].append(json.loads(lines[-1]) if lines else {"conf": conf, "error": done.stderr[-2000:]})
        print(done.stdout.strip() or done.stderr[-2000:], flush=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
