"""The `megatron` engine (GPU): megatron-core's GPTModel built from the catalog model with the plan's
TP/PP/VPP/EP/ETP/DP and sequence parallelism wherever TP > 1 (megatron_model.py), its pipeline split and its
optimizer (foreach or fused AdamW, or offloaded to the host: model_chunks.py), trained here with megatron's DDP +
distributed optimizer (gradient reduce-scatter overlapped with the backward, the parameters' all-gather with the
next forward: ParamGather) on a synthetic Markov-chain stream or an indexed dataset through megatron-core's
GPTDataset (data.py), saved with dist-checkpointing. Standard library + torch + megatron-core only (shipped as a
file).

Without TransformerEngine, stock megatron-core's local layer spec uses an unfused attention (half the speed,
2.3x the memory of SDPA: FACTS); this engine puts torch SDPA in its place (flash or cuDNN kernels, causal,
GQA), or flash-attn's kernel when flash-attn is importable. Context parallelism needs TE's attention and is
refused at render time; MoE experts run on torch._grouped_mm (experts_grouped.py) instead of SequentialMLP's loop.
Checkpoints need a directory that all ranks share (one node, or a shared FS).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import compile_warm
import data
import host_copy
import megatron_ckpt
import megatron_resume
import model_chunks
import moe_stats
import rope
import torch
import torch.distributed as dist
import traces
from megatron_model import (  # noqa: F401  (re-exported: the engine's model-building names, as before the split)
    build_model,
    ddp_config_kwargs,
    keep_router_counts_fp32,
    known_config_kwargs,
    load_balancing_kwargs,
    parallel_sizes,
    router_bias_update,
    sdpa_core_attention,
    transformer_config_kwargs,
)
from metrics import RankFiles, log
from schedule import lr_at

WEIGHT_DECAY = model_chunks.WEIGHT_DECAY

@dataclass
class Run:
    """What a rank trains with, built once by `build`: the megatron config, the model chunks (their DDP model, as
    one), the optimizer, the data and the router statistics (MoE)."""

    cfg: dict[str, Any]
    rank: int
    world: int
    micro_batches: int
    config: Any  # megatron's TransformerConfig
    chunks: list[Any]
    model: Any
    optimizer: Any
    stats: moe_stats.RouterStats | None
    mtp_layers: int
    batches: Callable[[int], Iterator[tuple[torch.Tensor, torch.Tensor]]]  # one iteration's micro-batches
    forward_step: Any
    trace: traces.MemoryTrace
    resume_from: Any  # what skip_initialization found to resume from


def train(cfg: dict[str, Any], out_dir: Path, files: RankFiles) -> int:
    from megatron.core import parallel_state as ps

    t = cfg["training"]
    # STEPDEPLOY_PROFILE_START=1: this start's model build and checkpoint read under cProfile (traces.py)
    profile = (traces.FirstStepProfile(out_dir, dist.get_rank(), 0, "start")
               if os.environ.get("STEPDEPLOY_PROFILE_START") == "1" else None)
    if profile is not None:
        profile.start()
    compile_warm.start(dist.get_rank(), torch.cuda.current_device())  # beside the build and the read
    building = time.perf_counter()
    run = build(cfg, out_dir, files)
    if run.resume_from:  # a restart: every kernel is in the node's compile cache
        compile_warm.compile_in_process(run.rank)
    ckpt_dir, load_parts = out_dir / "checkpoints", {}
    # the save's one-off set-up starts now, in the background, when this run saves at all: the writer processes it
    # spawns start while the checkpoint is read (the GPU idle), not beside the first step
    host = host_copy.host_dir(cfg["run_id"], run.rank, ckpt_dir)  # None: not kept (the log says why)
    saver = megatron_ckpt.Saver(ckpt_dir, files, t.get("keep_checkpoints", 2), run.rank,
                                prepare=bool(t["save_interval"]), host=host_copy.Copier(host, run.rank))
    loading = time.time()
    start = megatron_resume.resume(run.model, run.optimizer, ckpt_dir, run.rank, load_parts, run.resume_from, host)
    files.phase("resumed", iteration=start, load_s=round(time.time() - loading, 3), load_parts=load_parts)
    if profile is not None:
        profile.stop(time.perf_counter() - building)
    for group in run.optimizer.param_groups:
        # as megatron's OptimizerParamScheduler: no decay for the groups it marks wd_mult 0 (norms, biases)
        group["weight_decay"] = WEIGHT_DECAY * group.get("wd_mult", 1.0)
    torch.cuda.reset_peak_memory_stats()
    loop(run, files, saver, start, out_dir)
    saver.finish(t["iterations"])
    run.trace.mark("end")
    ps.destroy_model_parallel()
    return 0


def build(cfg: dict[str, Any], out_dir: Path, files: RankFiles) -> Run:
    """Megatron's parallel state, the model and its optimizer, the data: everything before the checkpoint's read."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    t = cfg["training"]
    seq, mbs, gbs = t["seq_length"], t["micro_batch_size"], t["global_batch_size"]
    ps.initialize_model_parallel(**parallel_sizes(cfg))
    model_parallel_cuda_manual_seed(t["seed"])
    files.phase("parallel_state")
    dp = ps.get_data_parallel_world_size()
    micro_batches = gbs // (mbs * dp)
    overrides = config_overrides(rank, "STEPDEPLOY_MCORE_OVERRIDES")
    config_kwargs = transformer_config_kwargs(cfg) | overrides
    rope_note = rope.prepare(config_kwargs)  # apply_rope_fusion without TE: rope.py's kernel on megatron's path
    if rope_note:
        log(rank, rope_note)
    config = TransformerConfig(**known_config_kwargs(config_kwargs, TransformerConfig.__dataclass_fields__, rank))
    resume_from = megatron_resume.skip_initialization(config, out_dir / "checkpoints", rank)
    files.phase("found", iteration=resume_from)
    trace = traces.MemoryTrace(out_dir, rank)
    p = cfg["parallel"]
    ddp = ddp_config_kwargs(cfg) | config_overrides(rank, "STEPDEPLOY_DDP_OVERRIDES")
    chunks = model_chunks.wrap_chunks([c.cuda() for c in model_chunks.build_chunks(cfg, config, build_model)],
                                      config, ddp)
    keep_router_counts_fp32(chunks)
    model = model_chunks.as_one_model(chunks)  # the DDP model, or with VPP its chunks in one
    trace.mark("model")
    files.phase("model")
    model_chunks.attach_grad_sync(config, chunks, ddp["overlap_grad_reduce"])
    optimizer = model_chunks.build_optimizer(cfg, chunks)
    trace.mark("optimizer")
    files.phase("optimizer")
    params = sum(q.numel() for q in model.parameters())
    log(rank, f"megatron engine: {params:,} parameters on this rank, world {world}, DP {dp}, "
              f"{micro_batches} micro-batch(es) of {mbs}x{seq}, layout {p}")
    if config.moe_router_enable_expert_bias:
        log(rank, f"router expert bias: update rate {config.moe_router_bias_update_rate}"
                  + ("" if router_bias_update(p) else " (parallel.router_bias_update off: the bias stays at zero)"))
    m = cfg["model"]
    stats = moe_stats.RouterStats(m["num_layers"] + (m.get("mtp_num_layers") or 0), m["moe"]["num_experts"],
                                  m["moe"]["topk"], "cuda", micro_batches) if m["moe"] else None
    if stats is not None:
        stats.watch_megatron(model)
    source = data.source_for(cfg, ps.get_data_parallel_rank(), micro_batches, "cuda", megatron=True)
    positions = torch.arange(seq, device="cuda").unsqueeze(0).expand(mbs, -1)

    def batches(iteration: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for micro in range(micro_batches):
            tokens = source.micro_batch(iteration, micro)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return Run(cfg, rank, world, micro_batches, config, chunks, model, optimizer, stats, m.get("mtp_num_layers") or 0,
               batches, model_chunks.lm_forward_step(positions), trace, resume_from)


def loop(run: Run, files: RankFiles, saver: megatron_ckpt.Saver, start: int, out_dir: Path) -> None:
    """The iterations after `start`, each timed from the end of the one before (so the report and the loop's own
    overhead count) to the end of its optimizer step on the compute stream (an overlapped param gather may still
    be running); saves at the save interval."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    t = run.cfg["training"]
    forward_backward = get_forward_backward_func()
    profile = traces.StepProfile(out_dir, run.rank, os.environ.get("STEPDEPLOY_PROFILE"), first_step=start + 1)
    backward_done, step_done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gather = ParamGather(run.model)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for iteration in range(start + 1, t["iterations"] + 1):
        profile.before(iteration)
        lr = lr_at(iteration, t)
        losses, grad_norm = step_once(run, iteration, lr, forward_backward, backward_done, gather, start)
        step_done.record()
        step_done.synchronize()
        ended = time.perf_counter()
        step = ended - began
        profiled = profile.after(iteration, step)
        record(run, files, iteration, losses, grad_norm, lr, step, backward_done.elapsed_time(step_done) / 1e3,
               profiled)
        if iteration == start + 1:
            files.phase("first_step", iteration=iteration, step_s=round(step, 4))
            saver.prepare_host_memory(run.model, run.optimizer)  # the optimizer's state exists now
            ended = time.perf_counter()  # the next step's time does not include it
        began = time.perf_counter() if profiled else ended  # not the profiler's write-out either
        if saver.poll():  # a save in flight ended everywhere and was committed
            began = time.perf_counter()  # its finalize is the checkpoint's time (save_committed), not a step's
        if t["save_interval"] and iteration % t["save_interval"] == 0:
            saver.save(run.model, run.optimizer, iteration)
            began = time.perf_counter()  # a save is not the next step's time


def step_once(run: Run, iteration: int, lr: float, forward_backward: Any, backward_done: Any, gather: ParamGather,
              start: int) -> tuple[list[Any], Any]:
    """One iteration's forward, backward and optimizer step (the param gather dispatched after it): (the
    micro-batches' losses, the gradient norm)."""
    t = run.cfg["training"]
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.model.zero_grad_buffer()
    run.optimizer.zero_grad()
    feeds = [run.batches(iteration) for _ in run.chunks]  # one stream per chunk: each sees every micro-batch once
    losses = forward_backward(forward_step_func=run.forward_step,
                              data_iterator=feeds if len(run.chunks) > 1 else feeds[0], model=run.chunks,
                              num_microbatches=run.micro_batches, seq_length=t["seq_length"],
                              micro_batch_size=t["micro_batch_size"], decoder_seq_length=t["seq_length"],
                              forward_only=False)
    if iteration <= start + 2:
        run.trace.mark(f"forward_backward_{iteration - start}")
    # the phase split is read from CUDA events after the step: a synchronize here would idle the GPU while
    # the host starts the optimizer step (a fixed cost per step, which DP does not shrink)
    backward_done.record()
    _ok, grad_norm, _zeros = run.optimizer.step()
    gather.dispatch()
    if iteration <= start + 2:
        run.trace.mark(f"optimizer_step_{iteration - start}")
    return losses, grad_norm


def record(run: Run, files: RankFiles, iteration: int, losses: list[Any], grad_norm: Any, lr: float, step: float,
           optimizer_s: float, profiled: bool) -> None:
    """The step's metrics line (rank 0) and heartbeat: its loss averaged over micro-batches, its phase split."""
    from megatron.core import parallel_state as ps

    phases: dict[str, Any] = {"forward_backward_s": round(step - optimizer_s, 4), "optimizer_s": round(optimizer_s, 4)}
    if profiled:
        phases["profiled"] = True  # the profiler's overhead is in this step: means leave it out
    loss = (sum(x["lm loss"] for x in losses) / len(losses)).float() if losses else torch.zeros((), device="cuda")
    if run.stats is not None:
        phases |= run.stats.reduce()
    mtp = moe_stats.mtp_losses(run.mtp_layers, run.micro_batches, "cuda") if run.mtp_layers else None
    report(run.cfg, files, iteration, loss, grad_norm, lr, step, run.world, ps.is_pipeline_last_stage(), phases, mtp)


class ParamGather:
    """The distributed optimizer's overlapped parameter all-gather, dispatched whole right after each optimizer
    step in forward order, instead of megatron's default: one bucket at a time from the next forward's module
    pre-hooks. Those launch NCCL from the host in the middle of the forward -- in the MoE layers just after the
    router's device-to-host sync, when the GPU has nothing queued -- so on 2 H200s overlapping cost more forward
    time than the gather it hid (docs/benchmarks.md). Dispatched here, the gather runs under the step's end and
    the next forward, and the pre-hooks only wait for their bucket (megatron's own skip for a gather already
    dispatched by the optimizer step). Off unless the DDP config overlaps the param gather."""

    def __init__(self, model: Any) -> None:
        self.groups: list[Any] = []
        if not model.ddp_config.overlap_param_gather:
            return
        model.overlap_param_gather_with_optimizer_step = True  # pre-hooks wait, never dispatch
        order = {id(param): i for i, param in enumerate(model.parameters())}  # registration = forward order
        groups = [*model.bucket_groups, *model.expert_parallel_bucket_groups]
        self.groups = sorted(groups, key=lambda g: min(order[id(q)] for b in g.buckets for q in b.params_list))

    def dispatch(self) -> None:
        for group in self.groups:
            group.start_param_sync()


def config_overrides(rank: int, variable: str) -> dict[str, Any]:
    """megatron-core config fields from a JSON object in the environment (`render --env` sets it), for measuring
    an option before making it the engine's default: STEPDEPLOY_MCORE_OVERRIDES for TransformerConfig,
    STEPDEPLOY_DDP_OVERRIDES for DistributedDataParallelConfig. The planner does not know about them."""
    overrides = json.loads(os.environ.get(variable) or "{}")
    if not isinstance(overrides, dict):
        raise ValueError(f"{variable} must be a JSON object, got {overrides!r}")
    if overrides:
        log(rank, f"overrides from {variable}: {overrides}")
    return overrides


def report(cfg: dict[str, Any], files: RankFiles, iteration: int, loss: torch.Tensor, grad_norm: float | None,
           lr: float, step: float, world: int, last_stage: bool, phases: dict[str, Any] | None = None,
           mtp: torch.Tensor | None = None) -> None:
    """`phases`: extra keys for the metrics line; `mtp`: this rank's MTP losses (averaged like the LM loss)."""
    t = cfg["training"]
    # one collective and one device-to-host copy: [loss sum, last-stage ranks, each rank's step s, each rank's peak,
    # the MTP losses' sums]
    n_mtp = 0 if mtp is None else mtp.numel()
    mine = torch.zeros(2 + 2 * world + n_mtp)
    rank = dist.get_rank()
    mine[1], mine[2 + rank] = float(last_stage), step
    mine[2 + world + rank] = torch.cuda.max_memory_allocated() / 2**30
    stats = mine.cuda()
    if last_stage:
        stats[0] += loss.float()
        if mtp is not None:
            stats[2 + 2 * world:] += mtp
    dist.all_reduce(stats)
    got = stats.tolist()
    times, peak = got[2:2 + world], max(got[2 + world:2 + 2 * world])
    if n_mtp:
        phases = (phases or {}) | {"mtp_loss": [round(x / got[1], 5) for x in got[2 + 2 * world:]]}
    files.beat(iteration)
    if files.rank != 0:
        return
    slowest = max(times)
    tokens_per_s = t["global_batch_size"] * t["seq_length"] / slowest
    mfu = None
    if cfg.get("peak_tflops"):
        mfu = round(cfg["flops_per_token"] * tokens_per_s / (cfg["peak_tflops"] * 1e12 * world), 4)
    values = {"iteration": iteration, "loss": round(got[0] / got[1], 5),
              "grad_norm": None if grad_norm is None else round(float(grad_norm), 5), "lr": lr,
              "step_time_s": round(slowest, 4), "tokens_per_s": round(tokens_per_s, 1),
              "rank_step_time_s": [round(float(x), 4) for x in times],
              "mem_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
              "mem_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2),
              "mem_peak_gib": round(float(peak), 2), "mfu": mfu, "time": time.time(), **(phases or {})}
    files.record(values)
    log(0, f"iter {iteration}/{t['iterations']} loss {values['loss']:.4f} step {slowest:.3f}s "
           f"{tokens_per_s:,.0f} tok/s MFU {mfu} peak {values['mem_peak_gib']} GiB")
