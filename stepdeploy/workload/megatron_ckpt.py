"""The megatron engine's checkpoints: megatron-core dist-checkpointing of the model and the (distributed)
optimizer into a directory all ranks share, committed by rank 0 with ckpt.py's protocol, and the resume that
puts back what megatron-core's load leaves out. Standard library + torch + megatron-core only (shipped as a file).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ckpt
import torch
import torch.distributed as dist
from metrics import log


def save(model: Any, optimizer: Any, ckpt_dir: Path, iteration: int, rank: int) -> None:
    """dist-checkpointing into a staging directory; rank 0 commits it (rename, then `latest`)."""
    from megatron.core import dist_checkpointing

    if getattr(getattr(model, "ddp_config", None), "overlap_param_gather", False):
        # overlapped param all-gather: after the step each rank holds only its own shard's new weights until
        # the next forward gathers the rest; the model's state dict must see every weight (megatron's training
        # loop does the same before a save)
        with torch.no_grad():
            model.start_param_sync(force_sync=True)
    if rank == 0:
        ckpt.staging_dir(ckpt_dir, iteration)
    dist.barrier()
    staging = ckpt_dir / f".{ckpt.iteration_name(iteration)}.tmp"
    # megatron adds process groups to the metadata dict it is given: each use gets a fresh one
    state = sharded_state(model, optimizer, is_loading=False, metadata=checkpoint_metadata(optimizer))
    dist_checkpointing.save(state, str(staging), content_metadata=checkpoint_metadata(optimizer))
    dist.barrier()
    if rank == 0:
        ckpt.atomic_write_json(staging / "stepdeploy.json", {"iteration": iteration, "optimizer": True,
                                                             "metadata": checkpoint_metadata(optimizer)})
        ckpt.commit(ckpt_dir, iteration)
        log(0, f"checkpoint {iteration} committed")
    dist.barrier()


def distopt_sharding() -> str:
    """The distributed optimizer's checkpoint format (STEPDEPLOY_DISTOPT_SHARDING overrides, for experiments).

    dp_reshardable: every rank writes and reads its own optimizer shard, no gather (resharding only in DP)."""
    return os.environ.get("STEPDEPLOY_DISTOPT_SHARDING", "dp_reshardable")


def checkpoint_metadata(optimizer: Any) -> dict[str, Any]:
    """What megatron's own training loop passes to sharded_state_dict (and saves as the checkpoint's content
    metadata, so a load builds its state dict for the format the checkpoint holds)."""
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if _is_distributed(optimizer):
        metadata["distrib_optim_sharding_type"] = distopt_sharding()
    return metadata


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers under a ChainedOptimizer (dense and expert parameters), or the one given."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def _is_distributed(optimizer: Any) -> bool:
    return any(type(o).__name__ == "DistributedOptimizer" for o in inner_optimizers(optimizer))


def sharded_state(model: Any, optimizer: Any, is_loading: bool, metadata: dict[str, Any]) -> dict:
    """The model's and the optimizer's sharded state dicts, built as megatron's training loop builds them."""
    model_sd = model.module.sharded_state_dict(metadata=metadata)  # through DDP to Float16Module -> GPTModel
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}


def resume(model: Any, optimizer: Any, ckpt_dir: Path, rank: int) -> int:
    """Load the checkpoint `latest` names (all ranks share ckpt_dir): weights and optimizer state, or fail
    loudly (a resume that silently drops the optimizer state is not a resume). 0 for a fresh start."""
    from megatron.core import dist_checkpointing

    iteration = ckpt.latest_iteration(ckpt_dir)
    if iteration is None:
        return 0
    where = ckpt_dir / ckpt.iteration_name(iteration)
    metadata = dist_checkpointing.load_content_metadata(str(where)) or checkpoint_metadata(optimizer)
    materialize_optimizer_state(optimizer)
    state = sharded_state(model, optimizer, is_loading=True, metadata=dict(metadata))
    loaded = dist_checkpointing.load(state, str(where))
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    restore_adam_steps(optimizer, loaded["optimizer"])
    log(rank, f"resumed from checkpoint {iteration} (weights and optimizer state, "
              f"{metadata.get('distrib_optim_sharding_type', 'no distributed optimizer')})")
    return iteration


def materialize_optimizer_state(optimizer: Any) -> None:
    """torch's Adam creates its state (step, exp_avg, exp_avg_sq) at its first step, and megatron's
    DistributedOptimizer.state_dict() -- called to build the state dict a checkpoint loads into -- asserts
    that it exists (with Apex/TE's FusedAdam it need not). Take one zero-gradient step on every inner
    optimizer that has no state yet; the load then overwrites every value, main parameters included."""
    for inner in inner_optimizers(optimizer):
        torch_optimizer = inner.optimizer
        if len(torch_optimizer.state):
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)


def restore_adam_steps(optimizer: Any, loaded: Any) -> None:
    """Put back Adam's step count after a load. With torch's Adam (no Apex/TE) megatron-core 0.16-0.19's
    dp_reshardable load restores `step` from the checkpoint's param_groups, then copies every 0-dim state
    tensor of the bucket state over it -- `step` included, which that format keeps local (not saved) -- so
    the step silently becomes the fresh optimizer's. Adam's bias correction depends on it."""
    inners = inner_optimizers(optimizer)
    states = [loaded] if len(inners) == 1 else [state for _key, state in sorted(loaded.items())]
    for inner, state in zip(inners, states, strict=True):
        groups = state.get("optimizer", {}).get("param_groups", []) if isinstance(state, dict) else []
        steps = {float(g["step"]) for g in groups if g.get("step") is not None}
        if len(steps) != 1:
            continue
        step = steps.pop()
        for param_state in inner.optimizer.state.values():
            old = param_state.get("step")
            if torch.is_tensor(old):
                # a tensor of its own per parameter: the load can leave one `step` tensor shared by every
                # parameter, and torch's Adam then adds 1 to it once per parameter at every step
                param_state["step"] = torch.full_like(old, step)
