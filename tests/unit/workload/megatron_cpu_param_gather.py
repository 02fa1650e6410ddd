"""Run by test_megatron_param_gather.py in a process of its own: the megatron engine's ParamGather against
megatron-core's own overlapped param gather, with expert parallelism, on 4 CPU ranks (gloo): EP 2, so the
experts' buckets all-gather over an expert data-parallel group of 2 and the rest over DP 4. Each rank trains the
tiny MoE model three steps with megatron's dispatch (a bucket at a time from the forward's pre-hooks), then a
model built from the same seed three steps with the engine's (every bucket after the optimizer step), with the
engine's own DDP configuration (NCCL-style averaging in the collective; gloo has AVG). Rank 0 prints one JSON
line: the losses of both, the weights that differ on any rank, and the bucket groups of each kind.

gloo carries megatron's collectives one by one here, not coalesced (megatron_cpu.uncoalesced_collectives).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def rank_main(rank: int, port: int, out: str) -> None:
    sys.path.insert(0, str(HERE))
    from megatron_cpu import megatron_on_cpu, one_step, token_batches

    megatron_on_cpu(rank, 4, port)
    import engine_megatron as em
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import Layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    cfg = workload_config(load_model("tiny-moe"), Layout(ep=2, mbs=2), RenderOptions(run_id="t", seq_length=32,
                          global_batch_size=8), engine="megatron", world=4, peak_tflops=790.0)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    kwargs = em.transformer_config_kwargs(cfg) | {"use_cpu_initialization": True,
                                                   "moe_token_dispatcher_type": "allgather",
        "moe_shared_expert_overlap": False}  # alltoall: a CUDA stream
    ddp_kwargs = em.ddp_config_kwargs(cfg) | {"bucket_size": 20_000}  # several buckets of each kind

    def build() -> tuple[Any, Any]:
        torch.manual_seed(1)
        config = TransformerConfig(**kwargs)
        model = Float16Module(config, em.build_model(cfg, config))
        model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(**ddp_kwargs),
                                        module=model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0,
                                                           use_distributed_optimizer=True), [model])
        return model, optimizer

    pool = token_batches(cfg["model"]["vocab_size"], 16, ps.get_data_parallel_rank())
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)

    outside: list[int] = []  # bucket-group dispatches that did not come from ParamGather.dispatch, per step
    inside = [False]

    def counting(fn: Any) -> Any:
        def wrap(*args: Any, **kwargs: Any) -> Any:
            outside[-1] += not inside[0]
            return fn(*args, **kwargs)
        return wrap

    def train(gather_after_step: bool) -> tuple[list[float], dict[str, torch.Tensor], Any]:
        model, optimizer = build()
        gather = em.ParamGather(model) if gather_after_step else None
        for group in [*model.bucket_groups, *model.expert_parallel_bucket_groups]:
            group.start_param_sync = counting(group.start_param_sync)
        outside.clear()
        losses = []
        def dispatch() -> None:
            inside[0] = True
            gather.dispatch()
            inside[0] = False

        for step in range(3):
            outside.append(0)
            losses.append(one_step(model, optimizer, pool[step], positions, dispatch if gather else None))
        outside.append(0)  # the last entry: the synchronous gather before a save
        with torch.no_grad():
            model.start_param_sync(force_sync=True)  # every weight, as a save sees it
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, model

    lazy_losses, lazy_params, _ = train(gather_after_step=False)
    lazy_outside = list(outside)
    eager_losses, eager_params, model = train(gather_after_step=True)
    eager_outside = list(outside)
    differing = torch.tensor([float(sum(not torch.equal(p, lazy_params[n]) for n, p in eager_params.items()))])
    moved = torch.tensor([float(sum(not torch.equal(p, q) for p, q in zip(eager_params.values(),
                                                                          build()[0].parameters(), strict=True)))])
    dist.all_reduce(differing)
    dist.all_reduce(moved)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "lazy_losses": lazy_losses, "eager_losses": eager_losses, "params": len(eager_params),
            "params_differing_on_any_rank": differing.item(), "params_trained_on_all_ranks": moved.item(),
            "dense_groups": len(model.bucket_groups), "expert_groups": len(model.expert_parallel_bucket_groups),
            "dispatched_by_megatron_per_step": {"lazy": lazy_outside, "eager": eager_outside},
            "average_in_collective": ddp_kwargs["average_in_collective"],
            "overlap_param_gather": ddp_kwargs["overlap_param_gather"]}))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    from megatron_cpu import free_port

    torch.multiprocessing.spawn(rank_main, args=(free_port(), sys.argv[1]), nprocs=4, join=True)
    print(Path(sys.argv[1]).read_text())
