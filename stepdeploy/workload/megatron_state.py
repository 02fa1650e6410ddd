"""The megatron engine's checkpoint state: the sharded state dicts a save writes and a load reads, built as
megatron's training loop builds them, the host copies a save makes, and what megatron-core's load leaves out
(the optimizer's state before a load, Adam's step count after it). Split from megatron_ckpt.py, which re-exports
these names. Standard library + torch + megatron-core only (shipped as a file).
"""

from __future__ import annotations

import os
from typing import Any

import torch


def host_copy_sizes(model: Any, optimizer: Any, device_type: str = "cuda") -> list[int]:
    """The bytes of each host copy this rank's save makes: one per tensor of a ShardedTensor this rank writes (its
    main replica: megatron's keep_only_main_replica), after megatron's factories (the save's own preprocessing),
    on `device_type`, not empty. Local (no collective), for the distributed optimizer's dp_reshardable format;
    other formats gather across ranks to build their state dict: none then."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent

    metadata = checkpoint_metadata(optimizer)
    if metadata.get("distrib_optim_sharding_type", "dp_reshardable") != "dp_reshardable":
        return []
    state = sharded_state(model, optimizer, is_loading=False, metadata=metadata)
    apply_factories(state)
    _, state = extract_nonpersistent(state)
    return [t.data.numel() * t.data.element_size() for t in nested_values(state)
            if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id) and t.data is not None
            and t.data.device.type == device_type and t.data.numel()]


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
