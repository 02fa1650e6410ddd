"""Exploration only (bench/gpu_ckpt_io.py), not the product: a checkpoint read with several threads.

torch.distributed.checkpoint's FileSystemReader goes through the items one at a time (per item: read the bytes,
torch.load them on the CPU, copy them into the target tensor). On an H200 the dense proxy's 10 GiB restart read takes
9-10 s that way, from memory (tmpfs). ParallelReader spreads the items over threads (the planner's calls one at a
time, in a lock; the copy into the target outside it unless megatron-core's planner kept a tensor between
resolve_tensor and commit_tensor). On the H200 it did not help: 1.1-1.4 GB/s with 1 or 8 threads, into host tensors
as into device ones, so torch.load's per-item work holds the GIL; the device copies are 1.6 s of the 9-10
(docs/benchmarks-log.md). Standard library + torch only.
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future


class ParallelReader(FileSystemReader):
    """FileSystemReader with read_data spread over `threads` threads (1: torch's, unchanged)."""

    def __init__(self, path: str | os.PathLike[str], threads: int) -> None:
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        infos = [self.storage_data[item.storage_index] for item in plan.items]
        if self.threads <= 1 or any(getattr(info, "transform_descriptors", None) for info in infos):
            return super().read_data(plan, planner)  # transformed (compressed) items: torch's path
        order = sorted(range(len(infos)), key=lambda i: (infos[i].relative_path, infos[i].offset))
        lock = threading.Lock()

        def read(part: list[int]) -> None:
            streams: dict[str, Any] = {}
            try:
                for i in part:
                    item, info = plan.items[i], infos[i]
                    stream = streams.get(info.relative_path)
                    if stream is None:
                        stream = streams[info.relative_path] = open(  # noqa: SIM115 (closed below)
                            self.fs.concat_path(self.path, info.relative_path), "rb")
                    stream.seek(info.offset)
                    data = io.BytesIO(stream.read(info.length))
                    if item.type == LoadItemType.BYTE_IO:
                        with lock:
                            planner.load_bytes(item, data)
                        continue
                    tensor = torch.load(data, map_location="cpu", weights_only=True)
                    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                    with lock:
                        target = planner.resolve_tensor(item).detach()
                        if target.size() != tensor.size():
                            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs "
                                                 f"{tensor.size()}")
                        if _stashed(planner):  # a tensor kept until commit_tensor: nothing in between
                            target.copy_(tensor)
                            planner.commit_tensor(item, target)
                            continue
                    target.copy_(tensor)  # the device copy (GIL released) beside the other threads' reads
                    with lock:
                        planner.commit_tensor(item, target)
            finally:
                for stream in streams.values():
                    stream.close()

        with ThreadPoolExecutor(self.threads, thread_name_prefix="checkpoint-read") as pool:
            for done in [pool.submit(read, part) for part in _split(order, infos, self.threads)]:
                done.result()  # the first error, raised here
        result: Future[None] = Future()
        result.set_result(None)
        return result


def _stashed(planner: LoadPlanner) -> bool:
    """Whether megatron-core's planner kept something between resolve_tensor and commit_tensor (its FP8 and
    quantized destinations: 0.16 `_intermediate_read_item_and_target`, 0.19 `_intermediate_read_items`)."""
    return bool(getattr(planner, "_intermediate_read_item_and_target", None)
                or getattr(planner, "_intermediate_read_items", None))


def _split(order: list[int], infos: list[Any], parts: int) -> list[list[int]]:
    """`order` (items sorted by file and offset) cut into at most `parts` runs of about equal bytes."""
    total = sum(infos[i].length for i in order) or 1
    runs: list[list[int]] = [[]]
    done = 0
    for i in order:
        if runs[-1] and done >= total * len(runs) / parts and len(runs) < parts:
            runs.append([])
        runs[-1].append(i)
        done += infos[i].length
    return runs
