"""Memory per GPU for every pipeline stage, by component; the worst stage decides whether a layout fits.

`torch_allocated` is what torch.cuda.max_memory_allocated() would report on that stage's GPUs: the
persistent state (weights, gradients, optimizer state) plus the larger of two transient peaks, the
forward-backward one (activations, logits, dispatcher buffers; at the start of backward) and the
optimizer-step one (torch Adam's foreach temporaries). NCCL buffers, the CUDA context, the checkpoint writer's
own CUDA context on the same GPU (another process) and allocator fragmentation come on top of it in nvidia-smi.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.catalog import MIB
from stepdeploy.plan import activations as act
from stepdeploy.plan.cluster import ClusterShape
from stepdeploy.plan.layout import Job, Layout
from stepdeploy.plan.params import ParamCount
from stepdeploy.plan.stages import PipelineStage, stage_params, stages

WEIGHT_BYTES = 2  # bf16 parameters
GRAD_BYTES = 4  # fp32 main gradients (accumulate-allreduce-grads-in-fp32)
OPTIMIZER_BYTES = 12  # fp32 master copy + Adam m and v
# torch.optim.AdamW (megatron-core's optimizer without apex/TE) steps each param group with foreach ops;
# _multi_tensor_adam allocates sqrt(v) for the whole group in fp32 (4 B per parameter it owns) while
# m, v, master weights and fp32 grads stay. Measured on H200: MBS-1 peaks = state + 4 B/param
# (docs/benchmarks.md, 2026-11-29: dense 15.19 GiB, MoE 72.94 GiB on 1 GPU).
ADAM_STEP_BYTES = 4
# torch's fused AdamW (Layout.optimizer "fused") updates each tensor group in one kernel with no such temporary
# (assumed from torch's _fused_adamw: it writes m, v and the parameter in place; not yet measured here).
ADAM_STEP_BYTES_BY_IMPLEMENTATION = {"foreach": ADAM_STEP_BYTES, "fused": 0}
NCCL_BASE_MIB = 256  # assumed: NCCL workspace of the first communicator
NCCL_PER_GROUP_MIB = 128  # assumed: each further process group of size > 1
FLEX_BUFFER_MIB = 1024  # assumed: DeepEP (flex dispatcher) NVLink + RDMA buffers
FRAGMENTATION = 0.05  # assumed: reserved-but-unallocated share of the caching allocator
# The megatron engine's persistent checkpoint writer (one process per rank, for asynchronous saves) holds a CUDA
# context on its rank's GPU: measured 518 MiB on an H200 (nvidia-smi, docs/benchmarks.md calls AB-AD; other GPUs
# assumed the same)
CHECKPOINT_WRITER_MIB = 518

STATE_COMPONENTS = ("weights", "gradients", "optimizer")
FORWARD_BACKWARD = ("activations", "logits", "dispatcher")  # transient: the forward-backward peak
TORCH_COMPONENTS = (*STATE_COMPONENTS, *FORWARD_BACKWARD, "optimizer_step")
COMPONENTS = (*TORCH_COMPONENTS, "nccl", "cuda_context", "checkpoint_writer", "fragmentation")


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: int
    components: dict[str, float]  # bytes per GPU
    host_offload: float = 0.0  # bytes per GPU moved to host memory (optimizer CPU offload)

    @property
    def state(self) -> float:
        return sum(self.components[name] for name in STATE_COMPONENTS)

    @property
    def forward_backward_peak(self) -> float:
        return self.state + sum(self.components[name] for name in FORWARD_BACKWARD)

    @property
    def optimizer_step_peak(self) -> float:
        return self.state + self.components["optimizer_step"]

    @property
    def torch_allocated(self) -> float:
        """The peak of torch.cuda.max_memory_allocated(): state + the larger transient."""
        return max(self.forward_backward_peak, self.optimizer_step_peak)

    @property
    def total(self) -> float:
        return self.torch_allocated + sum(
            value for name, value in self.components.items() if name not in TORCH_COMPONENTS
        )

    def largest(self) -> str:
        return max(self.components, key=lambda name: self.components[name])


@dataclass(frozen=True)
class MemoryEstimate:
    stages: tuple[StageMemory, ...]
    capacity: float  # bytes a process may use on one GPU
    margin: float
    host_capacity: float | None = None  # host bytes per GPU for offloaded state; None = unknown

    @property
    def host_worst(self) -> StageMemory:
        return max(self.stages, key=lambda stage: stage.host_offload)

    @property
    def host_fits(self) -> bool:
        if self.host_capacity is None or not self.host_worst.host_offload:
            return True
        return self.host_worst.host_offload <= self.host_capacity * (1 - self.margin)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda stage: stage.total)

    @property
    def budget(self) -> float:
        return self.capacity * (1 - self.margin)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.budget and self.host_fits

    @property
    def overflow(self) -> float:
        return self.worst.total - self.budget


def _optimizer_shards(job: Job, layout: Layout) -> tuple[int, int]:
    """Distributed-optimizer shard counts: DP*CP ranks share dense params, EDP ranks share experts."""
    if not layout.distributed_optimizer:
        return 1, 1
    return job.dp(layout) * layout.cp, job.edp(layout)


def _state_bytes(
    params: ParamCount, job: Job, layout: Layout, stage: PipelineStage, unified: bool
) -> dict[str, float]:
    held = stage_params(params, stage, layout)
    dense_shards, expert_shards = _optimizer_shards(job, layout)
    dense_owned, expert_owned = held.dense / dense_shards, held.expert / expert_shards
    optimizer = OPTIMIZER_BYTES * (dense_owned + expert_owned)
    offloaded = optimizer if layout.optimizer_cpu_offload and not unified else 0.0
    # Expert params get their own optimizer (a ChainedOptimizer steps them one after the other) when they
    # use expert process groups (EP > 1 or ETP != TP); otherwise they share the dense param groups.
    own_groups = layout.ep > 1 or layout.etp != layout.tp
    largest_group = max(dense_owned, expert_owned) if own_groups else dense_owned + expert_owned
    return {
        "weights": WEIGHT_BYTES * held.total,
        "gradients": GRAD_BYTES * held.total,
        "optimizer": optimizer - offloaded,
        "optimizer_step": 0.0 if layout.optimizer_cpu_offload
        else ADAM_STEP_BYTES_BY_IMPLEMENTATION[layout.optimizer] * largest_group,
        "host_offload": offloaded,
    }


def _activation_bytes(job: Job, layout: Layout, stage: PipelineStage, logits: float) -> float:
    spec, seq = job.model, job.seq_length
    decoder = [layer for layer in stage.layers if not layer.mtp_extra]
    mtp = [layer for layer in stage.layers if layer.mtp_extra]
    per_microbatch = sum(act.layer_activation_bytes(spec, layer, layout, seq) for layer in decoder)
    held = per_microbatch * act.in_flight_microbatches(layout, stage.index, job.microbatches(layout))
    held += sum(act.full_layer_bytes(spec, layer, layout, seq) for layer in mtp)  # one micro-batch
    if layout.recompute == "full" and decoder:
        # The re-run layer's working set exists only after the logits' backward has freed them (measured
        # memtrace, dense 1 H200 MBS 4 full recompute: forward-backward peak = state + layer inputs + logits).
        working_set = max(act.full_layer_bytes(spec, layer, layout, seq) for layer in decoder)
        held += max(0.0, working_set - logits)
    return held


def _dispatcher_bytes(job: Job, layout: Layout, stage: PipelineStage) -> float:
    moe = job.model.moe
    if moe is None or not any(layer.shape.ffn == "moe" for layer in stage.layers):
        return 0.0
    if layout.dispatcher == "flex":
        return FLEX_BUFFER_MIB * MIB
    tokens = act.token_shards(job.seq_length, layout).hidden
    row = job.model.hidden_size * act.BF16
    if layout.dispatcher == "allgather":
        return tokens * layout.ep * layout.etp * row * 2
    return 2 * tokens * moe.topk * row  # permuted input + all-to-all receive buffer


def _nccl_bytes(job: Job, layout: Layout) -> float:
    groups = (layout.tp, layout.pp, layout.cp, job.dp(layout), layout.ep, layout.etp, job.edp(layout))
    return (NCCL_BASE_MIB + NCCL_PER_GROUP_MIB * sum(size > 1 for size in groups)) * MIB


def stage_memory(
    params: ParamCount, job: Job, layout: Layout, cluster: ClusterShape, stage: PipelineStage
) -> StageMemory:
    parts = _state_bytes(params, job, layout, stage, cluster.gpu.unified_memory)
    host_offload = parts.pop("host_offload")
    parts["logits"] = act.logits_bytes(job.model, layout, job.seq_length) if stage.last else 0.0
    parts["activations"] = _activation_bytes(job, layout, stage, parts["logits"])
    parts["dispatcher"] = _dispatcher_bytes(job, layout, stage)
    allocated = max(sum(parts[name] for name in (*STATE_COMPONENTS, *FORWARD_BACKWARD)),
                    sum(parts[name] for name in (*STATE_COMPONENTS, "optimizer_step")))
    parts["nccl"] = _nccl_bytes(job, layout)
    parts["cuda_context"] = cluster.gpu.cuda_context_mib * MIB
    parts["checkpoint_writer"] = CHECKPOINT_WRITER_MIB * MIB
    parts["fragmentation"] = FRAGMENTATION * allocated
    decoder_layers = sum(1 for layer in stage.layers if not layer.mtp_extra)
    return StageMemory(stage.index, decoder_layers, parts, host_offload=host_offload)


def estimate_memory(
    params: ParamCount, job: Job, layout: Layout, cluster: ClusterShape, margin: float = 0.10
) -> MemoryEstimate:
    per_stage = tuple(
        stage_memory(params, job, layout, cluster, stage) for stage in stages(params, job, layout)
    )
    host = cluster.gpu.host_memory_gib_per_gpu
    return MemoryEstimate(per_stage, capacity=float(cluster.gpu.usable_bytes), margin=margin,
                          host_capacity=host * 1024**3 if host else None)
