"""Predicted step time: compute at a calibrated efficiency, exposed communication, pipeline bubble.

Rank order in Megatron's default grid is tp-cp-ep-dp-pp: TP is innermost, so a TP group stays inside
a node when TP <= GPUs per node; CP spans TP*CP ranks, DP TP*CP*DP, the expert groups ETP*EP.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.catalog import Hardware
from stepdeploy.plan.activations import BF16, token_shards
from stepdeploy.plan.cluster import ClusterShape
from stepdeploy.plan.flops import model_flops_per_step, stage_flops_per_token
from stepdeploy.plan.layout import Job, Layout
from stepdeploy.plan.params import ParamCount
from stepdeploy.plan.stages import Stage, stage_params, stages

GB = 1e9
OFFLOAD_PCIE_GBPS = 50.0  # assumed: host <-> GPU copies of gradients and parameters under CPU offload


@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute: float
    communication: float
    bubble: float
    optimizer: float
    tokens_per_second: float
    mfu: float  # model FLOPs / (time x GPUs x peak used)
    peak_tflops: float


def _collective_seconds(bytes_moved: float, ranks: int, busbw_gbps: float) -> float:
    if ranks <= 1:
        return 0.0
    return bytes_moved * (ranks - 1) / ranks / (busbw_gbps * GB)


def _microbatch_comm(job: Job, layout: Layout, cluster: ClusterShape, stage: Stage, overlap: float) -> float:
    spec, shards = job.model, token_shards(job.seq_length, layout)
    row = spec.hidden_size * BF16
    layers = len(stage.layers)
    moe_layers = sum(1 for layer in stage.layers if layer.shape.ffn == "moe")
    tp_bytes = 8 * shards.attention * row  # AG + RS around attention and MLP, forward and backward
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


def _grad_sync(params: ParamCount, job: Job, layout: Layout, cluster: ClusterShape, stage: Stage) -> float:
    held = stage_params(params, stage, layout)
    per_param = 4 + 2 if layout.distributed_optimizer else 2 * 4  # RS fp32 + AG bf16, or an fp32 all-reduce
    dp_ranks, dp_span = job.dp(layout) * layout.cp, cluster.world // layout.pp
    edp_ranks = job.edp(layout)
    dense = _collective_seconds(per_param * held.dense, dp_ranks, cluster.group_busbw_gbps(dp_span))
    expert = _collective_seconds(per_param * held.expert, edp_ranks, cluster.group_busbw_gbps(dp_span))
    return dense + expert


def _optimizer_step(
    params: ParamCount, job: Job, layout: Layout, cluster: ClusterShape, stage: Stage
) -> float:
    held = stage_params(params, stage, layout)
    shards = (job.dp(layout) * layout.cp, job.edp(layout)) if layout.distributed_optimizer else (1, 1)
    owned = held.dense / shards[0] + held.expert / shards[1]
    if layout.optimizer_cpu_offload:
        return held.total * (4 + 2) / (OFFLOAD_PCIE_GBPS * GB)
    return owned * 30 / (cluster.gpu.memory_bandwidth_gbps * GB)  # read+write master, m, v; grad; param


def predict_step_time(
    params: ParamCount, job: Job, layout: Layout, cluster: ClusterShape, hardware: Hardware
) -> StepTime:
    eff = hardware.efficiency
    peak = hardware.peak_tflops(cluster.gpu) * 1e12
    expert_eff = eff.experts_grouped_gemm if layout.grouped_gemm else eff.experts_sequential
    tokens_per_mb = layout.mbs * job.seq_length
    compute, comm = [], []
    for stage in stages(params, job, layout):
        flops = stage_flops_per_token(params, job.model, stage.layers, stage.last, job.seq_length, layout)
        per_gpu = tokens_per_mb / (layout.tp * layout.cp)
        compute.append(per_gpu * (flops.dense / eff.dense + flops.expert / expert_eff) / peak)
        comm.append(_microbatch_comm(job, layout, cluster, stage, eff.comm_overlap))
    slowest = max(c + m for c, m in zip(compute, comm, strict=True))
    microbatches = job.microbatches(layout)
    bubble = (layout.pp - 1) / layout.vpp * slowest
    last = stages(params, job, layout)[-1]
    sync = _grad_sync(params, job, layout, cluster, last) * (1 - eff.comm_overlap)
    optimizer = _optimizer_step(params, job, layout, cluster, last)
    seconds = microbatches * slowest + bubble + sync + optimizer
    model_flops = model_flops_per_step(params, job.model, job.seq_length, job.global_batch_size)
    return StepTime(
        seconds=seconds,
        compute=microbatches * max(compute),
        communication=microbatches * max(comm) + sync,
        bubble=bubble,
        optimizer=optimizer,
        tokens_per_second=job.global_batch_size * job.seq_length / seconds,
        mfu=model_flops / (seconds * job.world * peak),
        peak_tflops=peak / 1e12,
    )
