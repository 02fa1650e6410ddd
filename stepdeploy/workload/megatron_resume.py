"""The megatron engine's restore: which checkpoint every rank loads, the model built without the random
initialization the load overwrites, and the load itself -- weights and optimizer state, read straight from the files
(ckpt_read.py), from the node's host copy where it holds the same files (host_copy.py) -- with what megatron-core's
load leaves out put back (megatron_state.py). Split from megatron_ckpt.py (the save). Standard library + torch +
megatron-core only (shipped as a file).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ckpt
import ckpt_read
import host_copy
import torch
import torch.distributed as dist
from megatron_state import checkpoint_metadata, materialize_optimizer_state, restore_adam_steps, sharded_state
from metrics import log


def find(ckpt_dir: Path, rank: int) -> int:
    """Every rank: the iteration a resume loads -- rank 0 repairs the store (all ranks share it), then the newest
    committed checkpoint every rank sees (0: a fresh start)."""
    if rank == 0:
        for action in ckpt.repair(ckpt_dir):
            log(rank, f"checkpoints: {action}")
    dist.barrier()
    mine = ckpt.committed_iterations(ckpt_dir)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if mine != everyone[0]:
        log(rank, f"checkpoints: this rank sees {mine or 'none'} in {ckpt_dir}, rank 0 sees {everyone[0] or 'none'}: "
                  "the megatron engine needs a checkpoint directory every rank shares")
    return ckpt.newest_common(everyone)


def skip_initialization(config: Any, ckpt_dir: Path, rank: int) -> int:
    """Before the model is built: when a checkpoint will be loaded, the weights' random initialization is work the
    load overwrites (megatron-core's perform_initialization=False, meant for this; every weight must then come from
    the checkpoint, which the strict load_state_dict of resume() checks). Returns find()'s iteration."""
    iteration = find(ckpt_dir, rank)
    if iteration and initialization_skippable(config):
        config.perform_initialization = False
        log(rank, f"checkpoint {iteration} will be loaded: weights not initialized")
    return iteration


def initialization_skippable(config: Any) -> bool:
    """megatron-core before 0.19 sets a tensor-parallel weight's attributes (tensor_model_parallel, partition_dim)
    only in the initialization it skips; without them a TP (or expert-TP) rank other than 0 leaves its shards out
    of the gradient norm. 0.19 sets them either way; with TP 1 and expert TP 1 nothing reads them."""
    from megatron.core import package_info

    version = tuple(int(part) for part in package_info.__version__.split(".")[:2])
    whole = config.tensor_model_parallel_size == 1 and (config.expert_tensor_parallel_size or 1) == 1
    return version >= (0, 19) or whole


def resume(model: Any, optimizer: Any, ckpt_dir: Path, rank: int, parts: dict[str, float] | None = None,
           iteration: int | None = None, host: Path | None = None) -> int:
    """Load the newest complete checkpoint (or `iteration`, find()'s answer): weights and optimizer state, or fail
    loudly (a resume that silently drops the optimizer state is not a resume). 0 for a fresh start. `parts`:
    filled with the seconds each part of the load took (where a restart's time goes); `host`: this rank's host copy
    directory (host_copy.py), read where it holds the same files."""
    from megatron.core import dist_checkpointing

    clock = _PartClock(parts if parts is not None else {})
    iteration = find(ckpt_dir, rank) if iteration is None else iteration
    clock.lap("find")
    if iteration == 0:
        return 0
    where = ckpt_dir / ckpt.iteration_name(iteration)
    metadata = dist_checkpointing.load_content_metadata(str(where)) or checkpoint_metadata(optimizer)
    materialize_optimizer_state(optimizer)
    clock.lap("optimizer_state")
    state = sharded_state(model, optimizer, is_loading=True, metadata=dict(metadata))
    clock.lap("state_dict")
    reads = ckpt_read.ReadStats()
    copies, found = host_copy.usable(host, where, iteration)
    log(rank, f"checkpoint {iteration}: {found}")
    # the read straight from the files (ckpt_read.py); STEPDEPLOY_CKPT_FASTREAD=0: torch's reader for every item
    # (and no host copy)
    direct = {"sharded_strategy": ckpt_read.load_strategy(reads, copies)} if ckpt_read.enabled() else {}
    loaded = dist_checkpointing.load(state, str(where), **direct)
    clock.lap("read")
    clock.parts.update(reads.summary())
    model.module.load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    restore_adam_steps(optimizer, loaded["optimizer"])
    clock.lap("apply")
    log(rank, f"resumed from checkpoint {iteration} (weights and optimizer state, "
              f"{metadata.get('distrib_optim_sharding_type', 'no distributed optimizer')}); read "
              f"{reads.direct_bytes / 1e9:.2f} GB directly ({reads.host_bytes / 1e9:.2f} GB of it from the host "
              f"copy, the rest from storage) at {reads.summary()['read_gbps']} GB/s, "
              f"{reads.other_tensors} tensors and {reads.objects} objects through torch's reader")
    return iteration


class _PartClock:
    def __init__(self, parts: dict[str, float]) -> None:
        self.parts, self.last = parts, time.perf_counter()

    def lap(self, name: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.parts[name] = round(now - self.last, 3)
        self.last = now
