"""The megatron engine's model and optimizer as the plan's layout shapes them: interleaved virtual pipelines (one
model chunk per virtual stage, each wrapped in megatron's DDP), the pipeline split the planner chose (uneven first
and last stages included), and the optimizer: torch's AdamW with its foreach or fused kernels, or megatron-core's
HybridDeviceOptimizer with the whole optimizer state and step on the host (optimizer CPU offload).

Everything here is stock megatron-core (0.16.1 and 0.19): virtual_pipeline_model_parallel_size and GPTModel's
vp_stage, num_layers_in_first/last_pipeline_stage, OptimizerConfig's optimizer_cpu_offload with the
precision-aware optimizer. Standard library + torch + megatron-core only (shipped as a file).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

WEIGHT_DECAY = 0.1


def pipeline_kwargs(p: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig arguments of the pipeline layout (pure): the virtual pipeline size, p2p overlap (the
    interleaved schedule's; megatron refuses it together with batched p2p) and the stage sizes the plan chose."""
    kwargs: dict[str, Any] = {}
    if p.get("vpp", 1) > 1:
        overlap = bool(p.get("overlap_p2p_comm", True))
        kwargs |= {"virtual_pipeline_model_parallel_size": p["vpp"], "overlap_p2p_comm": overlap,
                   "batch_p2p_comm": not overlap}
        if p.get("vpp_microbatch_group"):  # the planner's (plan.layout.vpp_group_size): megatron's default is PP
            kwargs["microbatch_group_size_per_vp_stage"] = p["vpp_microbatch_group"]
    if p.get("first_stage_layers") is not None:
        kwargs["num_layers_in_first_pipeline_stage"] = p["first_stage_layers"]
    if p.get("last_stage_layers") is not None:
        kwargs["num_layers_in_last_pipeline_stage"] = p["last_stage_layers"]
    return kwargs


def optimizer_config_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """megatron-core OptimizerConfig arguments (pure). Offload: the precision-aware optimizer's path, which is the
    one megatron-core takes for optimizer_cpu_offload without TransformerEngine (HybridDeviceOptimizer with a
    fused torch AdamW on the host, offload fraction 1: the parameters' host copies and the gradients' are pinned; the
    fp32 master copies it makes of bf16 parameters and torch's Adam state are ordinary host memory)."""
    t, p = cfg["training"], cfg["parallel"]
    kwargs: dict[str, Any] = {
        "optimizer": "adam", "lr": t["lr"], "weight_decay": WEIGHT_DECAY, "adam_beta1": 0.9, "adam_beta2": 0.95,
        "bf16": True, "use_distributed_optimizer": p["distributed_optimizer"], "clip_grad": 1.0}
    if p.get("optimizer_cpu_offload"):
        kwargs |= {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0,
                   "use_precision_aware_optimizer": True, "overlap_cpu_optimizer_d2h_h2d": False}
    return kwargs


def virtual_stages(cfg: dict[str, Any]) -> int:
    return int(cfg["parallel"].get("vpp", 1))


def lm_forward_step(positions: torch.Tensor) -> Callable[[Any, Any], Any]:
    """megatron's forward_step_func: the next (tokens, labels) of the chunk's stream through the chunk, and the
    language-model loss (only the last stage's output is a loss; the schedule calls loss_func there)."""

    def forward_step(data_iterator: Any, model_chunk: Any) -> Any:
        tokens, labels = next(data_iterator)
        output = model_chunk(tokens, positions, None, labels=labels)

        def loss_func(output_tensor: torch.Tensor) -> Any:
            loss = output_tensor.float().mean()
            # clone: the schedule divides the returned loss by the micro-batch count in place
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    return forward_step


def build_chunks(cfg: dict[str, Any], config: Any, build: Callable[..., Any]) -> list[Any]:
    """One model per virtual pipeline stage of this rank (one without VPP): `build(cfg, config, pre_process,
    post_process, vp_stage)` makes it; only the first virtual stage of the first rank embeds, only the last of the
    last rank has the output layer."""
    from megatron.core import parallel_state as ps

    vpp = virtual_stages(cfg)
    if vpp == 1:
        return [build(cfg, config, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(), None)]
    return [build(cfg, config, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                  ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage), stage) for stage in range(vpp)]


def wrap_chunks(chunks: list[Any], config: Any, ddp_kwargs: dict[str, Any]) -> list[Any]:
    """Float16Module + megatron DDP per chunk; buckets only for the first (megatron's training loop: the other
    chunks' gradients are reduced as one bucket each, when their backward ends)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, chunk),
                                    disable_bucketing=index > 0) for index, chunk in enumerate(chunks)]


def attach_grad_sync(config: Any, models: list[Any], overlap_grad_reduce: bool) -> None:
    """The schedule's hooks into DDP: one function for a single model, a list per chunk with VPP."""
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [m.no_sync for m in models]
    config.no_sync_func = no_sync[0] if len(models) == 1 else no_sync
    if overlap_grad_reduce:
        sync = [m.start_grad_sync for m in models]
        config.grad_sync_func = sync[0] if len(models) == 1 else sync


def build_optimizer(cfg: dict[str, Any], models: list[Any]) -> Any:
    """megatron's optimizer over every chunk, then torch AdamW's implementation as the layout says: foreach
    (torch's default on GPUs; its step allocates sqrt(v) for a whole param group, 4 B per parameter) or fused
    (one kernel per group of tensors, no such temporary). Offload builds megatron's HybridDeviceOptimizer."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _te_version_without_te()
    optimizer = get_megatron_optimizer(OptimizerConfig(**optimizer_config_kwargs(cfg)), models)
    if not cfg["parallel"].get("optimizer_cpu_offload"):
        set_adam_implementation(optimizer, cfg["parallel"].get("optimizer", "foreach"))
    return optimizer


def _te_version_without_te() -> None:
    """megatron-core 0.16.1's get_te_version() returns None without TransformerEngine, and the precision-aware
    optimizer's config check (is_te_min_version) then fails comparing None; 0.19 answers 0.0.0. Answer as 0.19."""
    from megatron.core import utils

    if getattr(utils, "_te_version", None) is None and utils.get_te_version() is None:
        from packaging.version import Version

        utils._te_version = Version("0.0.0")


def torch_optimizers(optimizer: Any) -> Iterator[Any]:
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        yield inner.optimizer


def set_adam_implementation(optimizer: Any, implementation: str) -> None:
    """torch.optim.AdamW reads `foreach` and `fused` from each param group at every step, and creates its state
    (with the step counter where the fused kernel wants it) at the first: set before that step, the group runs
    the kernel named. Apex/TE's FusedAdam (when installed) is fused already and left alone."""
    if implementation not in ("foreach", "fused"):
        raise ValueError(f"workload.json: optimizer is foreach or fused, got {implementation!r}")
    for inner in torch_optimizers(optimizer):
        if not isinstance(inner, torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = implementation == "fused", implementation == "foreach"


class ModelChunks(torch.nn.ModuleList):
    """The interleaved pipeline's chunks where the engine's loop and checkpoints expect one DDP model: grad
    buffers, parameter gathers and the sharded state dict are each chunk's in turn (the state dict as megatron's
    training loop keys it: model0, model1, ...)."""

    @property
    def ddp_config(self) -> Any:
        return self[0].ddp_config

    @property
    def bucket_groups(self) -> list[Any]:
        return [group for chunk in self for group in chunk.bucket_groups]

    @property
    def expert_parallel_bucket_groups(self) -> list[Any]:
        return [group for chunk in self for group in chunk.expert_parallel_bucket_groups]

    @property
    def module(self) -> ModelChunks:
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "overlap_param_gather_with_optimizer_step":  # ParamGather's switch: every chunk's
            for chunk in self:
                setattr(chunk, name, value)
            return
        super().__setattr__(name, value)

    def zero_grad_buffer(self) -> None:
        for chunk in self:
            chunk.zero_grad_buffer()

    def start_param_sync(self, *args: Any, **kwargs: Any) -> None:
        for chunk in self:
            chunk.start_param_sync(*args, **kwargs)

    def sharded_state_dict(self, **kwargs: Any) -> dict[str, Any]:
        return {f"model{i}": chunk.module.sharded_state_dict(**kwargs) for i, chunk in enumerate(self)}

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        for i, chunk in enumerate(self):
            chunk.module.load_state_dict(state[f"model{i}"], strict=strict)


def as_one_model(models: list[Any]) -> Any:
    """The model the engine's loop, ParamGather and checkpoints hold: the DDP model itself, or its chunks."""
    return models[0] if len(models) == 1 else ModelChunks(models)
