"""Run by test_megatron_sequence_parallel.py in a process of its own: the megatron engine's model (megatron_model.py)
with and without sequence parallelism, trained a few steps on 2 CPU ranks (gloo) with megatron-core's own schedule,
DDP (gradients all-reduced after the backward: with the distributed optimizer a rank's gradient buffer holds
only its own shard reduced, and the CPU shim carries only gather and reduce-scatter asynchronously) and Adam, in
fp32, from the same seed and the same micro-batches:
- dense-tp2 and dense-tp2-sp: tiny-dense at TP 2 without and with sequence parallelism;
- moe-tp2-sp and moe-tp1: tiny-moe (routed experts, grouped, and a shared expert) at TP 2 with sequence
  parallelism, and at TP 1 (DP 2, both ranks fed the same micro-batches, so the averaged gradients are one
  replica's) from the TP 2 model's weights: megatron-core refuses to train an MoE layer at TP > 1 without SP
  (its no-SP path at TP 2, that guard lifted, doubles the experts' gradients: every TP rank dispatches the same
  whole sequence).
Each rank reports its losses and the first step's gradients (after finalize_model_grads: the norms' and routers'
all-reduced over TP under SP); rank 0 prints one JSON line with every run's reports.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
STEPS, SEQ, MBS, MICRO_BATCHES = 3, 32, 2, 2


def whole(name: str, param: Any, tensor: torch.Tensor, gated: bool) -> torch.Tensor:
    """`tensor` (the parameter or its gradient on this rank) as a TP 1 model holds it: a tensor-parallel shard
    gathered along its partition dim over TP (experts at ETP 1 are whole already), a gated fc1's [gate | up] halves
    put back together (each TP shard holds its own gate and up rows)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False) or not getattr(param, "allreduce", True):
        return tensor.detach().float().clone()
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    if gated and name.endswith("linear_fc1.weight"):
        halves = [part.chunk(2, dim=0) for part in parts]
        parts = [h[0] for h in halves] + [h[1] for h in halves]
    return torch.cat(parts, dim=param.partition_dim).float()


def run(name: str, model: str, layout_text: str, weights: dict[str, torch.Tensor] | None = None,
        seed: int = 3) -> dict[str, Any]:
    """Train `model` at `layout_text` from `seed` (or from `weights`, whole tensors by name) -> every rank's losses,
    first-step gradients (whole, as at TP 1) and initial weights (whole; rank 0's report carries them)."""
    import megatron_model as mm
    import model_chunks as mc
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_cpu import token_batches

    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import parse_layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import check_engine, workload_config

    spec, layout = load_model(model), parse_layout(layout_text)
    check_engine("megatron", layout, spec, 1)  # what render would refuse
    gbs = MICRO_BATCHES * MBS * 2 // (layout.tp * layout.pp)  # the same micro-batches a step at any DP
    cfg = workload_config(spec, layout, RenderOptions(run_id="t", seq_length=SEQ, global_batch_size=gbs,
                                                      iterations=STEPS), engine="megatron", world=2, peak_tflops=None)
    ps.initialize_model_parallel(**mm.parallel_sizes(cfg))
    torch.manual_seed(seed)
    kwargs = mm.transformer_config_kwargs(cfg) | {
        "use_cpu_initialization": True, "bf16": False, "params_dtype": torch.float32,
        "pipeline_dtype": torch.float32}
    if "num_moe_experts" in kwargs:  # 0.16.1's alltoall dispatcher and the shared-expert overlap need CUDA streams
        kwargs |= {"moe_token_dispatcher_type": "allgather", "moe_shared_expert_overlap": False}
    config = TransformerConfig(**kwargs)
    ddp = DistributedDataParallelConfig(**(mm.ddp_config_kwargs(cfg) | {"overlap_param_gather": False}))
    gpt = mm.build_model(cfg, config)
    if weights is not None:
        with torch.no_grad():
            for key, param in gpt.named_parameters():
                param.copy_(weights[key])
    gated = config.gated_linear_unit
    initial = {key: whole(key, param, param, gated) for key, param in gpt.named_parameters()}
    model_ = DistributedDataParallel(config=config, ddp_config=ddp, module=gpt)
    mc.attach_grad_sync(config, [model_], ddp.overlap_grad_reduce)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0,
                                                       use_distributed_optimizer=ddp.use_distributed_optimizer),
                                       [model_])
    micro_batches = gbs // (MBS * ps.get_data_parallel_world_size())
    # every rank the same micro-batches: TP ranks must, and DP ranks then average one replica's gradients
    pool = token_batches(spec.vocab_size, micro_batches, 0, rows=MBS, seq=SEQ)
    forward_step = mc.lm_forward_step(torch.arange(SEQ).unsqueeze(0).expand(MBS, -1))
    schedule = get_forward_backward_func()
    losses, grads = [], {}
    for step in range(STEPS):
        model_.zero_grad_buffer()
        optimizer.zero_grad()
        out = schedule(forward_step_func=forward_step,
                       data_iterator=iter([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in pool]),
                       model=[model_], num_microbatches=micro_batches, seq_length=SEQ, micro_batch_size=MBS,
                       decoder_seq_length=SEQ, forward_only=False)
        if step == 0:
            grads = {key.removeprefix("module."): whole(key, param, param.main_grad, gated).flatten().clone()
                     for key, param in model_.named_parameters()}
        optimizer.step()
        losses.append(float(sum(x["lm loss"] for x in out) / len(out)))
    marked = sorted(n for n, p in model_.named_parameters() if getattr(p, "sequence_parallel", False))
    report = {"rank": dist.get_rank(), "losses": losses, "grads": grads, "sequence_parallel": config.sequence_parallel,
              "marked": marked}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    ps.destroy_model_parallel()
    return {"name": name, "ranks": gathered, "initial": initial}


def rank_main(rank: int, port: int, out: str) -> None:
    sys.path.insert(0, str(HERE))
    from megatron_cpu import megatron_on_cpu

    megatron_on_cpu(rank, 2, port)
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # megatron-core's RoPE moves its frequencies to torch.cuda.current_device() on first use: keep them on the CPU
    torch.cuda.current_device = lambda: "cpu"
    # the embedding scatters the sequence (SP) under the model-parallel CUDA RNG; no dropout here draws from it
    get_cuda_rng_tracker().fork = lambda *_a, **_k: contextlib.nullcontext()
    results = [run("dense-tp2", "tiny-dense", "tp=2,mbs=2,sp=off,dist-opt=off,overlap_grad_reduce=off"),
               run("dense-tp2-sp", "tiny-dense", "tp=2,mbs=2,dist-opt=off,overlap_grad_reduce=off")]
    # megatron-core refuses to train an MoE layer at TP > 1 without SP: the reference is TP 1 from the same weights
    moe = run("moe-tp2-sp", "tiny-moe", "tp=2,mbs=2,dist-opt=off,overlap_grad_reduce=off")
    results += [moe, run("moe-tp1", "tiny-moe", "mbs=2,dist-opt=off,overlap_grad_reduce=off", weights=moe["initial"])]
    for result in results:
        del result["initial"]
    if rank == 0:
        torch.save(results, out)  # tensors, not JSON floats: the gradients are millions of numbers
    dist.destroy_process_group()


def main(out: str) -> None:
    """2 gloo ranks on this machine; rank 0 writes the results to `out` (torch.save)."""
    sys.path.insert(0, str(HERE))
    from megatron_cpu import free_port

    torch.multiprocessing.spawn(rank_main, args=(free_port(), out), nprocs=2, join=True)


if __name__ == "__main__":
    main(sys.argv[1])
