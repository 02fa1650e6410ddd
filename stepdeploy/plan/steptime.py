"""Predicted step time: compute at a calibrated efficiency, exposed communication, pipeline bubble, and the
host: a micro-batch takes about max(GPU time, host time), since the GPU cannot run kernels faster than Python
launches them (megatron-core's local spec launches many small kernels per layer).

Rank order in Megatron's default grid is tp-cp-ep-dp-pp: TP is innermost, so a TP group stays inside
a node when TP <= GPUs per node; CP spans TP*CP ranks, DP TP*CP*DP, the expert groups ETP*EP.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.catalog import Hardware
from stepdeploy.catalog.hardware import Efficiency
from stepdeploy.plan.activations import BF16, token_shards
from stepdeploy.plan.cluster import ClusterShape
from stepdeploy.plan.flops import model_flops_per_step, stage_flops_per_token
from stepdeploy.plan.layout import Job, Layout
from stepdeploy.plan.params import ParamCount
from stepdeploy.plan.stages import PipelineStage, stage_params, stages

GB = 1e9
# Optimizer CPU offload as the engine builds it (stepdeploy/workload/model_chunks.py): megatron-core's
# HybridDeviceOptimizer, offload fraction 1, precision-aware optimizer, overlap_cpu_optimizer_d2h_h2d off. It holds
# the distributed optimizer's shard (the parameters a rank owns), and per owned parameter and step moves, one part
# after the other on the current stream (megatron-core 0.16.1's cpu_offloading/hybrid_optimizer.py, torch's
# Copy.cu):
#   1. over PCIe, GPU to host: the fp32 gradient shard into pinned host buffers, 4 B;
#   2. on the host: torch.optim.AdamW(fused=True) over the fp32 master, gradient, m and v: reads 16 B, writes 12 B;
#   3. over PCIe, host to GPU: the fp32 master (pageable host memory: the fp32 copy of the pinned bf16 one is not
#      pinned), 4 B; a non-blocking copy_ into the bf16 parameter converts on the GPU, after the copy.
OFFLOAD_PCIE_BYTES = 4 + 4
OFFLOAD_PCIE_GBPS = 50.0  # assumed: PCIe Gen5 x16 (64 GB/s a direction) as copies achieve it
OFFLOAD_HOST_ADAM_BYTES = 16 + 12
# Host rate of step 2, per GPU. Measured on one H200 (nvidia-h200: the GPU with 16 CPU cores, as the 8-GPU kind
# has 128; torch 2.11.0+cu130, megatron-core 0.19.2), 2026-12-01, docs/benchmarks.md "Optimizer offload (issue
# 22)": the dense proxy (738,248,704 parameters, all owned) with mbs=4,offload=on,precision_aware_optimizer=on took
# 1.186 s a step, its optimizer phase 0.579 s. Less the PCIe copies (738.2M x 8 B / 50 GB/s = 0.118 s; the GPU's
# gradient clipping, a few ms, stays in) the host took 0.461 s for 738.2M x 28 B: 45 GB/s. (Both parts scale with
# the owned parameters: how the 0.579 s splits between them, e.g. a pageable copy slower than 50 GB/s, changes no
# prediction on this kind of host.) The planner assumed 25 GB/s before ("a GPU's share of ~200 GB/s over 8 GPUs",
# with 32 B, and 6 B over PCIe): its step was 1.65 s, 39 % over the measured, while the rest of the step was
# within 2 % of it (0.62 s against 0.607 s). The same command in a later call (U, docs/benchmarks.md "H200 calls
# T, U and V") took 1.359 s, its optimizer phase 0.738 s: the host's rate varies by that much between calls on one
# box; this fit is the faster run. Not measured: more than one rank on a host (their AdamW threads and memory
# traffic share the host; render gives each rank the node's CPUs / its GPUs as OMP_NUM_THREADS under offload), and
# hosts of other CPUs.
OFFLOAD_HOST_GBPS_PER_GPU = 45.0

# Host time (Python + kernel launches) of one micro-batch, forward + backward, per decoder layer.
# Fitted on H200, megatron-core 0.19.2 local spec + SDPA, together with the efficiencies in hardware.yaml, to
# 1-GPU runs (docs/benchmarks.md and docs/planner.md, 2026-11-29): the MBS-1 steps are host-bound (2x slower
# per token than MBS 4 with the same FLOPs): dense 1.280 s / 32 micro-batches / 12 layers ~ 3.3 ms; MoE with
# SequentialMLP 4.197 s / 32 / 12 ~ 10.8 ms (the expert loop and its device-to-host sync); MoE with the
# engine's grouped_mm experts 9.6 ms (MBS 2 selective 1.911 s vs MBS 4 1.332 s: routing and permutation
# dominate the host time, not the expert loop).
HOST_S_PER_LAYER = {"dense": 3.28e-3, "moe_sequential": 10.82e-3, "moe_grouped": 9.57e-3}
# Grouped experts with EP > 1: the alltoall dispatcher copies the split sizes to the host once per MoE layer
# (a sync); the GPU idles while the host catches up. (SequentialMLP syncs per layer anyway.) Measured: EP2 DP2
# MBS 4 grouped 0.848 s; fitted: 4.3 ms per MoE layer and micro-batch (with grouped_expert_efficiency's rows curve,
# which credits EP2's 4,096 rows per expert with faster GEMMs; 3.2 ms with a flat efficiency).
EP_SYNC_STALL_S = 4.3e-3
# overlap_param_gather within a node: the engine dispatches the whole all-gather after the optimizer step; it runs
# beside the step's end and the next forward's GEMMs (NCCL on SMs and HBM). Measured, 2 H200s, DP2 MBS 8, paired
# runs (2026-11-30): MoE proxy, the optimizer step took 14.9 ms less and the forward-backward 6.1 ms more than
# with the gather after the step: 0.4 of the gather stays exposed (dense proxy: about none of its 3.6 ms).
PARAM_GATHER_OVERLAP_IN_NODE = 0.4
# Measured: with 2 ranks on one host a host-bound micro-batch takes 1.2x as long (DP2 MBS 1: dense
# 0.789 s / 16 = 49 ms vs 40 ms on 1 GPU; MoE 2.505 s / 16 = 157 ms vs 131 ms).
HOST_MULTI_GPU = 1.2
HOST_FULL_RECOMPUTE = 4 / 3  # assumed: the re-run forward costs the host what it costs the GPU (1 of 3)
# A micro-batch takes (gpu^P + host^P)^(1/P): the larger of the two where one dominates, 12 % above it where
# they are equal (small kernels stay launch-bound and GEMMs GPU-bound, so the two never overlap perfectly).
# P = 6 fits the 2-GPU runs best (tried 3, 4, 5, 6, 8; the constants above were fitted with it).
HOST_OVERLAP_P = 6
# Per step, outside the micro-batches: schedule set-up, gradient-norm clipping (a Python loop over tensors),
# zeroing the grad buffer, the syncs around the optimizer step. Measured: dense runs of 2 micro-batches
# (gbs 8 and 16, iterations 3-4 of the lead's memtrace runs, 2026-11-29) took 12-15 ms more than predicted.
STEP_HOST_S = 0.014
# The optimizer step (megatron's gradient-norm clip, torch's foreach Adam over fp32 master weights, m and v, the
# copy back to bf16 parameters) per parameter a rank owns, as bytes moved at the GPU's measured copy bandwidth.
# The ideal is ~30 B (read grad, master, m, v; write master, m, v; write the bf16 param); measured on one H200,
# the engine's optimizer phase (optimizer_s in metrics.jsonl) took 22 ms for the dense proxy (0.738B owned), 90 ms
# for the MoE proxy (3.56B) and 99 ms for step-3.5-flash-slice-1gpu (3.44B): 25-30 ns per parameter, i.e. about
# 116 B at 4.3 TB/s (the 2-GPU DP2 runs own half: 47-64 ms MoE, 12-17 ms dense; docs/benchmarks.md).
OPTIMIZER_STEP_BYTES = 116
# torch's fused AdamW (Layout.optimizer "fused"), measured by bench/gpu_optim.sh on one H200 (2026-12-02, torch
# 2.11, megatron-core 0.19.2; docs/benchmarks.md "H200 calls T, U and V"): the dense proxy's optimizer phase took
# 12 ms against the foreach one's 22 ms in the same call, i.e. 0.012 s x 4.3 TB/s / 0.738B owned = 70 B per
# parameter (one kernel instead of a dozen foreach passes; the clipping and the bf16 copy stay).
FUSED_OPTIMIZER_STEP_BYTES = 70
OPTIMIZER_STEP_BYTES_BY_IMPLEMENTATION = {"foreach": OPTIMIZER_STEP_BYTES, "fused": FUSED_OPTIMIZER_STEP_BYTES}
# RoPE on q and k. The efficiencies in hardware.yaml were fitted to runs with megatron's unfused RoPE (about six
# element-wise kernels each way on each of q and k), so the unfused step is the calibrated one and the fused RoPE
# (Layout.rope_fusion, workload/rope.py: one compiled kernel each way) takes off the time of this many bytes per
# element of q and k at the GPU's memory bandwidth. Fitted on one H100 (2026-12-07, torch 2.11.0+cu130, megatron-core
# 0.19.2; docs/benchmarks.md "Issue 40", calls BE-BH): the dense proxy at MBS 8, three runs each, 0.6471 s unfused
# against 0.5785 s fused; 68.6 ms over 4 micro-batches x 12 layers x 67.1M elements at 3,350 GB/s = 71 B per element
# (the unfused kernels' ~50 B of traffic less the fused 8 B, run below the bandwidth, and their launches). Full
# recompute runs the forward again: of those ~42 B saved, the forward's are ~20 (~24 B unfused against 4 fused; the
# backward ~26 against 4), an estimate from the kernels, not a fit. Checked on the MoE proxy in the same call (the
# same attention; the planner's H100 layout has full recompute): predicted 1.398 s fused, measured 1.418 s (-1.4 %).
ROPE_UNFUSED_EXTRA_BYTES = 71
ROPE_FORWARD_SHARE = 20 / 42


def rope_fusion_saving(job: Job, layout: Layout, stage: PipelineStage, bandwidth_gbps: float) -> float:
    """Seconds of one micro-batch on `stage` that the fused RoPE saves (0 unfused or without RoPE): q and k of every
    layer, this rank's heads over its part of the sequence."""
    spec = job.model
    if not layout.rope_fusion or spec.position_embedding_type != "rope":
        return 0.0
    tokens = layout.mbs * job.seq_length / layout.cp
    heads = sum(layer.shape.num_heads + spec.num_query_groups for layer in stage.layers)
    elements = tokens * heads * spec.kv_channels / layout.tp
    passes = 1 + (ROPE_FORWARD_SHARE if layout.recompute == "full" else 0.0)  # selective recompute skips RoPE
    return elements * ROPE_UNFUSED_EXTRA_BYTES * passes / (bandwidth_gbps * GB)


def overlap(gpu: float, host: float) -> float:
    return (gpu**HOST_OVERLAP_P + host**HOST_OVERLAP_P) ** (1 / HOST_OVERLAP_P)


def host_seconds(stage: PipelineStage, layout: Layout, world: int) -> float:
    """Host time of one micro-batch on one stage (see HOST_S_PER_LAYER)."""
    moe = HOST_S_PER_LAYER["moe_grouped" if layout.grouped_experts else "moe_sequential"]
    per_layer = [moe if layer.shape.ffn == "moe" else HOST_S_PER_LAYER["dense"] for layer in stage.layers]
    seconds = sum(per_layer) * (HOST_FULL_RECOMPUTE if layout.recompute == "full" else 1.0)
    return seconds * (HOST_MULTI_GPU if world > 1 else 1.0)


@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute: float
    communication: float
    bubble: float
    optimizer: float
    host_bound: bool  # the slowest stage's micro-batch waits for the host, not the GPU
    tokens_per_second: float
    mfu: float  # model FLOPs / (time x GPUs x peak used)
    peak_tflops: float


def _collective_seconds(bytes_moved: float, ranks: int, busbw_gbps: float) -> float:
    if ranks <= 1:
        return 0.0
    return bytes_moved * (ranks - 1) / ranks / (busbw_gbps * GB)


def _microbatch_comm(job: Job, layout: Layout, cluster: ClusterShape, stage: PipelineStage, overlap: float) -> float:
    spec, shards = job.model, token_shards(job.seq_length, layout)
    row = spec.hidden_size * BF16
    layers = len(stage.layers)
    moe_layers = sum(1 for layer in stage.layers if layer.shape.ffn == "moe")
    # around attention and the MLP, forward and backward: with sequence parallelism an all-gather of the sequence
    # before each column-parallel linear and a reduce-scatter after each row-parallel one, without it an all-reduce
    # after each row-parallel linear (and its backward's before the column-parallel one); an all-reduce moves
    # what an all-gather and a reduce-scatter of the same tensor do together (2 (n-1)/n of it per rank), so the
    # bytes are the same either way -- what SP changes is the activations' memory (activations.token_shards)
    tp_bytes = 8 * shards.attention * row
    tp = layers * _collective_seconds(tp_bytes, layout.tp, cluster.group_busbw_gbps(layout.tp))
    ep = 0.0
    if spec.moe:
        ep_bytes = 4 * shards.hidden * spec.moe.topk * row  # dispatch + combine, forward and backward
        ep_span = layout.etp * layout.ep
        ep = moe_layers * _collective_seconds(ep_bytes, layout.ep, cluster.group_busbw_gbps(ep_span))
        etp_bytes = 4 * shards.hidden * spec.moe.topk * row * layout.etp  # AG in, RS out of the experts
        ep += moe_layers * _collective_seconds(etp_bytes, layout.etp, cluster.group_busbw_gbps(layout.etp))
        if layout.overlap_moe_expert_parallel_comm:
            ep *= 1 - overlap
    kv_bytes = 3 * shards.attention * 2 * spec.num_query_groups * spec.kv_channels * BF16
    cp = layers * _collective_seconds(kv_bytes, layout.cp, cluster.group_busbw_gbps(layout.tp * layout.cp))
    p2p = 0.0
    if layout.pp > 1:
        p2p = 2 * shards.hidden * row / (cluster.group_busbw_gbps(cluster.world) * GB)
    return tp + ep + cp * (1 - overlap) + p2p * (1 - overlap)


def _grad_sync(params: ParamCount, job: Job, layout: Layout, cluster: ClusterShape, stage: PipelineStage,
               overlap: float) -> float:
    """The part of the gradients' reduction (fp32 reduce-scatter, or an fp32 all-reduce without the distributed
    optimizer) and of the parameters' bf16 all-gather that compute does not hide. The reduction overlaps the last
    micro-batch's backward; the all-gather is exposed whole after the step, or overlaps the next forward with
    overlap_param_gather (within a node PARAM_GATHER_OVERLAP_IN_NODE of it stays exposed, measured)."""
    held = stage_params(params, stage, layout)
    dist_opt = layout.distributed_optimizer
    dp_ranks, dp_span = job.dp(layout) * layout.cp, cluster.world // layout.pp
    gather = 1.0
    if layout.param_gather_overlap:
        gather = PARAM_GATHER_OVERLAP_IN_NODE if dp_span <= cluster.gpus_per_node else 1 - overlap
    exposed = (4 if dist_opt else 2 * 4) * (1 - overlap) + (2 * gather if dist_opt else 0)
    edp_ranks = job.edp(layout)
    dense = _collective_seconds(exposed * held.dense, dp_ranks, cluster.group_busbw_gbps(dp_span))
    expert = _collective_seconds(exposed * held.expert, edp_ranks, cluster.group_busbw_gbps(dp_span))
    return dense + expert


def _optimizer_step(
    params: ParamCount, job: Job, layout: Layout, cluster: ClusterShape, stage: PipelineStage
) -> float:
    held = stage_params(params, stage, layout)
    shards = (job.dp(layout) * layout.cp, job.edp(layout)) if layout.distributed_optimizer else (1, 1)
    owned = held.dense / shards[0] + held.expert / shards[1]
    if layout.optimizer_cpu_offload:  # the copies too are the owned shard's (the held weights were counted before)
        return (owned * OFFLOAD_PCIE_BYTES / (OFFLOAD_PCIE_GBPS * GB)
                + owned * OFFLOAD_HOST_ADAM_BYTES / (OFFLOAD_HOST_GBPS_PER_GPU * GB))
    step_bytes = OPTIMIZER_STEP_BYTES_BY_IMPLEMENTATION[layout.optimizer]
    return owned * step_bytes / (cluster.gpu.memory_bandwidth_gbps * GB)


EXPERT_ROWS_REF = 2048  # rows per expert of the calibration runs: MBS 4 x seq 2048 x top-2 / 8 experts
EXPERT_WIDTH_REF = 8192  # expert FFN width of the calibration runs (proxy-0.7b-moe)


def grouped_expert_efficiency(eff: Efficiency, job: Job, layout: Layout) -> float:
    """Grouped expert GEMMs run faster the more rows each expert gets (fewer, fuller tiles) and the wider the
    expert (a narrow FFN makes short GEMMs whose fixed costs and routed-row handling weigh more per FLOP): two
    saturating curves, rows / (rows + half_rows) and width / (width + half_width), equal to experts_grouped_gemm
    at EXPERT_ROWS_REF rows and EXPERT_WIDTH_REF wide. Rows per expert per micro-batch: every EP rank's routed
    tokens reach each expert of its group."""
    moe = job.model.moe
    if moe is None or not eff.experts_grouped_half_rows:
        return eff.experts_grouped_gemm
    rows = layout.mbs * job.seq_length / layout.cp * moe.topk * layout.ep / moe.num_experts
    half = eff.experts_grouped_half_rows
    factor = (rows / (rows + half)) / (EXPERT_ROWS_REF / (EXPERT_ROWS_REF + half))
    if eff.experts_grouped_half_width:
        width, half_w = moe.ffn_hidden_size, eff.experts_grouped_half_width
        factor *= (width / (width + half_w)) / (EXPERT_WIDTH_REF / (EXPERT_WIDTH_REF + half_w))
    return min(1.0, eff.experts_grouped_gemm * factor)


def predict_step_time(
    params: ParamCount, job: Job, layout: Layout, cluster: ClusterShape, hardware: Hardware
) -> StepTime:
    eff = hardware.efficiency
    peak = hardware.peak_tflops(cluster.gpu) * 1e12
    expert_eff = grouped_expert_efficiency(eff, job, layout) if layout.grouped_experts else eff.experts_sequential
    tokens_per_mb = layout.mbs * job.seq_length
    compute, comm, host = [], [], []
    for stage in stages(params, job, layout):
        flops = stage_flops_per_token(params, job.model, stage.layers, stage.last, job.seq_length, layout)
        per_gpu = tokens_per_mb / (layout.tp * layout.cp)
        # (never below zero: the bytes term is fitted on 2,048-wide models and would outgrow a tiny model's compute)
        compute.append(max(0.0, per_gpu * (flops.dense / eff.dense + flops.expert / expert_eff) / peak
                           - rope_fusion_saving(job, layout, stage, cluster.gpu.memory_bandwidth_gbps)))
        stall = 0.0
        if layout.ep > 1 and layout.grouped_experts:
            stall = EP_SYNC_STALL_S * sum(1 for layer in stage.layers if layer.shape.ffn == "moe")
        comm.append(_microbatch_comm(job, layout, cluster, stage, eff.comm_overlap) + stall)
        host.append(host_seconds(stage, layout, job.world))
    gpu = max(c + m for c, m in zip(compute, comm, strict=True))
    slowest = overlap(gpu, max(host))
    microbatches = job.microbatches(layout)
    bubble = (layout.pp - 1) / layout.vpp * slowest
    last = stages(params, job, layout)[-1]
    sync = _grad_sync(params, job, layout, cluster, last, eff.comm_overlap)
    optimizer = _optimizer_step(params, job, layout, cluster, last)
    seconds = microbatches * slowest + bubble + sync + optimizer + STEP_HOST_S
    model_flops = model_flops_per_step(params, job.model, job.seq_length, job.global_batch_size)
    return StepTime(
        seconds=seconds,
        compute=microbatches * max(compute),
        communication=microbatches * max(comm) + sync,
        bubble=bubble,
        optimizer=optimizer,
        host_bound=max(host) > gpu,
        tokens_per_second=job.global_batch_size * job.seq_length / seconds,
        mfu=model_flops / (seconds * job.world * peak),
        peak_tflops=peak / 1e12,
    )
