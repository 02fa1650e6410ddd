"""Megatron-core's (0.19) start-up checks on a parallel layout, each as a rule with its reason in words.

A rule returns None when the layout passes, else one sentence saying what is wrong with THIS layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stepdeploy.plan.layout import Job, Layout, stage_layer_counts


@dataclass(frozen=True)
class Rule:
    name: str
    summary: str
    check: Callable[[Job, Layout], str | None]


def _world_grid(job: Job, lay: Layout) -> str | None:
    size = lay.tp * lay.pp * lay.cp
    if job.world % size:
        return f"TP*PP*CP = {size} does not divide the {job.world} GPUs"
    return None


def _expert_grid(job: Job, lay: Layout) -> str | None:
    size = lay.etp * lay.ep * lay.pp
    if job.world % size:
        return f"ETP*EP*PP = {size} does not divide the {job.world} GPUs (expert grid)"
    return None


def _experts_divide(job: Job, lay: Layout) -> str | None:
    moe = job.model.moe
    if moe is None:
        return (
            None
            if lay.ep == 1 and lay.etp == 1
            else f"EP={lay.ep} ETP={lay.etp} on a dense model (no experts)"
        )
    if moe.num_experts % lay.ep:
        return f"{moe.num_experts} experts do not divide over EP={lay.ep}"
    return None


def _heads_divide(job: Job, lay: Layout) -> str | None:
    bad = sorted(heads for heads in job.model.head_counts() if heads % lay.tp)
    return f"{bad[0]} attention heads do not divide over TP={lay.tp}" if bad else None


def _query_groups(job: Job, lay: Layout) -> str | None:
    groups = job.model.num_query_groups
    if groups % lay.tp and lay.tp % groups:
        return f"{groups} query groups are neither a multiple nor a divisor of TP={lay.tp}"
    return None


def _ffn_divides(job: Job, lay: Layout) -> str | None:
    if job.model.ffn_hidden_size % lay.tp:
        return f"FFN width {job.model.ffn_hidden_size} does not divide over TP={lay.tp}"
    moe = job.model.moe
    if moe and moe.ffn_hidden_size % lay.etp:
        return f"expert FFN width {moe.ffn_hidden_size} does not divide over ETP={lay.etp}"
    return None


def _pipeline_split(job: Job, lay: Layout) -> str | None:
    layers = job.model.num_layers
    if lay.pp > layers:
        return f"PP={lay.pp} exceeds the {layers} layers"
    counts = stage_layer_counts(layers, lay)
    if counts is None or min(counts) < 1:
        return f"{layers} layers have no split over PP={lay.pp} with these first/last stage sizes"
    return None


def _vpp_divides(job: Job, lay: Layout) -> str | None:
    if lay.vpp == 1:
        return None
    counts = stage_layer_counts(job.model.num_layers, lay) or ()
    bad = [count for count in counts if count % lay.vpp]
    return f"a stage of {bad[0]} layers does not divide into VPP={lay.vpp} chunks" if bad else None


def _vpp_needs_pp(job: Job, lay: Layout) -> str | None:
    if lay.vpp > 1 and lay.pp == 1:
        return f"VPP={lay.vpp} needs pipeline parallelism (PP>1)"
    if lay.vpp > 1 and lay.pp == 2 and not lay.overlap_p2p_comm:
        return "VPP with PP=2 needs overlap-p2p-comm"
    return None


def _vpp_microbatches(job: Job, lay: Layout) -> str | None:
    if lay.vpp == 1 or job.world % (lay.tp * lay.pp * lay.cp):
        return None
    count = job.microbatches(lay)
    if count < lay.pp:
        return (f"{count} micro-batch(es) per step, fewer than PP={lay.pp} (megatron-core's interleaved schedule "
                "runs at least PP in a group)")
    return None


def _sequence_parallel(job: Job, lay: Layout) -> str | None:
    if lay.sp and lay.tp == 1:
        return "sequence parallel needs TP>1"
    # megatron-core scatters the embedding's output along the sequence over TP (CP's slice of it, under CP)
    if lay.sp and (job.seq_length // lay.cp) % lay.tp:
        return f"sequence parallel splits the sequence ({job.seq_length // lay.cp}) over TP={lay.tp}: not a multiple"
    return None


def _context_parallel(job: Job, lay: Layout) -> str | None:
    # megatron-core checks `seq_length % (2 * context_parallel_size)` only when CP > 1: without CP any length runs
    if lay.cp > 1 and job.seq_length % (2 * lay.cp):
        return f"sequence {job.seq_length} is not a multiple of 2*CP = {2 * lay.cp} (load-balanced causal CP)"
    return None


def _batch_divides(job: Job, lay: Layout) -> str | None:
    if job.world % (lay.tp * lay.pp * lay.cp):
        return None  # reported by the world-grid rule
    per_step = lay.mbs * job.dp(lay)
    if job.global_batch_size % per_step:
        return f"global batch {job.global_batch_size} is not a multiple of MBS*DP = {per_step}"
    return None


def _param_gather(job: Job, lay: Layout) -> str | None:
    if lay.param_gather_overlap and not (lay.distributed_optimizer and lay.overlap_grad_reduce):
        return "overlap-param-gather needs the distributed optimizer and overlap-grad-reduce"
    return None


def _cpu_offload(job: Job, lay: Layout) -> str | None:
    if lay.optimizer_cpu_offload and not lay.precision_aware_optimizer:
        return "optimizer CPU offload needs the precision-aware optimizer"
    return None


def _moe_comm_overlap(job: Job, lay: Layout) -> str | None:
    if not lay.overlap_moe_expert_parallel_comm:
        return None
    if lay.ep == 1:
        return "overlap-moe-expert-parallel-comm needs EP>1"
    if lay.dispatcher not in ("alltoall", "flex"):
        return "overlap-moe-expert-parallel-comm needs the alltoall or flex dispatcher"
    if lay.recompute == "full":
        return "overlap-moe-expert-parallel-comm does not work with full recompute"
    if job.model.mtp_num_layers > 1:
        layers = job.model.mtp_num_layers
        return f"overlap-moe-expert-parallel-comm allows at most 1 MTP layer (model has {layers})"
    return None


RULES: tuple[Rule, ...] = (
    Rule("world-grid", "world % (TP*PP*CP) == 0", _world_grid),
    Rule("expert-grid", "world % (ETP*EP*PP) == 0 (MoE parallel folding)", _expert_grid),
    Rule("experts-per-ep", "num_experts % EP == 0; EP/ETP only on MoE models", _experts_divide),
    Rule("heads-per-tp", "attention heads % TP == 0 (every layer kind)", _heads_divide),
    Rule("query-groups-tp", "query groups a multiple or a divisor of TP", _query_groups),
    Rule("ffn-per-tp", "FFN width % TP == 0, expert FFN width % ETP == 0", _ffn_divides),
    Rule(
        "pipeline-split", "layers split over PP (even, or explicit first/last stage sizes)", _pipeline_split
    ),
    Rule("vpp-divides", "layers of every stage % VPP == 0", _vpp_divides),
    Rule("vpp-needs-pp", "VPP needs PP>1, and PP>2 unless overlap-p2p-comm", _vpp_needs_pp),
    Rule("vpp-microbatches", "with VPP, micro-batches per step >= PP", _vpp_microbatches),
    Rule("sp-needs-tp", "sequence parallel needs TP>1 and the sequence (per CP rank) % TP == 0",
         _sequence_parallel),
    Rule("cp-sequence", "with CP>1, sequence % (2*CP) == 0", _context_parallel),
    Rule("batch-divides", "global batch % (MBS*DP) == 0", _batch_divides),
    Rule(
        "param-gather",
        "overlap-param-gather needs distributed optimizer + overlap-grad-reduce",
        _param_gather,
    ),
    Rule("cpu-offload", "optimizer CPU offload needs the precision-aware optimizer", _cpu_offload),
    Rule(
        "moe-comm-overlap",
        "overlap-moe-expert-parallel-comm: EP>1, alltoall/flex, no full recompute, <=1 MTP layer",
        _moe_comm_overlap,
    ),
)


# Rules a knob of the search (micro-batch size) can repair; any other rule fails the whole structure.
KNOB_RULES = frozenset({"batch-divides", "vpp-microbatches"})


@dataclass(frozen=True)
class Violation:
    rule: str
    reason: str


def violations(job: Job, layout: Layout, rules: tuple[Rule, ...] = RULES) -> list[Violation]:
    """Every rule the layout breaks, in rule order."""
    found = []
    for rule in rules:
        reason = rule.check(job, layout)
        if reason:
            found.append(Violation(rule.name, reason))
    return found
