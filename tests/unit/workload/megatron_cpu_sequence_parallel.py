"""Run by test_megatron_sequence_parallel.py in a process of its own: the megatron engine's model (megatron_model.py)
with and without sequence parallelism, trained a few steps on 2 CPU ranks (gloo) with megatron-core's own schedule,
DDP (overlapped gradient reduction) and distributed Adam, in fp32, from the same seed and the same micro-batches:
- dense-tp2 and dense-tp2-sp: tiny-dense at TP 2 without and with sequence parallelism;
- moe-tp2 and moe-tp2-sp: tiny-moe (routed experts, grouped, and a shared expert) the same way; megatron-core
  refuses to train an MoE layer at TP > 1 without sequence parallelism, so the reference lifts that guard
  (lift_moe_tp_guard: a performance warning, the computation is the same).
Each rank reports its losses and the first step's gradients (after finalize_model_grads: the norms' and routers'
all-reduced over TP under SP); rank 0 prints one JSON line with every run's reports.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
STEPS, SEQ, MBS, GBS = 3, 32, 2, 4


def gradients(model: Any) -> dict[str, list[float]]:
    """Every parameter's main gradient on this rank (its tensor-parallel shard: the same shapes with and without
    sequence parallelism)."""
    return {name: param.main_grad.detach().float().flatten().tolist() for name, param in model.named_parameters()}


def lift_moe_tp_guard() -> None:
    """megatron-core 0.16.1's MoELayer refuses to train at TP > 1 without sequence parallelism ("performance may
    degrade"), a check of its own `training` flag and nothing else; the reference run without SP skips it."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    forward = MoELayer.forward

    def unguarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.training = False  # read by that check only (moe_layer.py); the router and experts keep their own
        try:
            return forward(self, *args, **kwargs)
        finally:
            self.training = True

    MoELayer.forward = unguarded


def run(name: str, model: str, layout_text: str, seed: int = 3) -> dict[str, Any]:
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
    cfg = workload_config(spec, layout, RenderOptions(run_id="t", seq_length=SEQ, global_batch_size=GBS,
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
    model_ = DistributedDataParallel(config=config, ddp_config=ddp, module=mm.build_model(cfg, config))
    mc.attach_grad_sync(config, [model_], ddp.overlap_grad_reduce)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0,
                                                       use_distributed_optimizer=True), [model_])
    micro_batches = GBS // (MBS * ps.get_data_parallel_world_size())
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
            grads = gradients(model_)
        optimizer.step()
        losses.append(float(sum(x["lm loss"] for x in out) / len(out)))
    marked = sorted(n for n, p in model_.named_parameters() if getattr(p, "sequence_parallel", False))
    report = {"rank": dist.get_rank(), "losses": losses, "grads": grads, "sequence_parallel": config.sequence_parallel,
              "marked": marked}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    ps.destroy_model_parallel()
    return {"name": name, "ranks": gathered}


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
    results = [run("dense-tp2", "tiny-dense", "tp=2,mbs=2,sp=off"),
               run("dense-tp2-sp", "tiny-dense", "tp=2,mbs=2"),
               run("moe-tp2-sp", "tiny-moe", "tp=2,mbs=2")]
    lift_moe_tp_guard()
    results.append(run("moe-tp2", "tiny-moe", "tp=2,mbs=2,sp=off"))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main(out: str) -> None:
    """2 gloo ranks on this machine; prints the JSON rank 0 wrote to `out`."""
    sys.path.insert(0, str(HERE))
    from megatron_cpu import free_port

    torch.multiprocessing.spawn(rank_main, args=(free_port(), out), nprocs=2, join=True)
    print(Path(out).read_text())


if __name__ == "__main__":
    main(sys.argv[1])
