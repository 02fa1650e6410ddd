"""Judge one layout, enumerate all of them, rank those that fit, find the smallest cluster that would fit."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import product

from stepdeploy.catalog import Hardware, ModelSpec
from stepdeploy.plan import engines
from stepdeploy.plan.cluster import ClusterShape
from stepdeploy.plan.constraints import KNOB_RULES, Violation, violations
from stepdeploy.plan.layout import AdamImplementation, Job, Layout
from stepdeploy.plan.memory import MemoryEstimate, estimate_memory
from stepdeploy.plan.params import ParamCount, count_parameters
from stepdeploy.plan.steptime import StepTime, predict_step_time

POWERS = (1, 2, 4, 8)
MICRO_BATCHES = (1, 2, 4, 8)  # 8: measured fastest for the dense proxy on one H200 (docs/benchmarks.md)
RECOMPUTE = ("none", "selective", "full")
# torch AdamW on the GPU: foreach (a sqrt(v) temporary per param group, 116 B moved per owned parameter) or fused
# (no temporary, 70 B; bench/gpu_optim.sh on one H200: 12 ms against 22 ms for the dense proxy)
ADAM_IMPLEMENTATIONS: tuple[AdamImplementation, ...] = ("foreach", "fused")


@dataclass(frozen=True)
class LayoutVerdict:
    layout: Layout
    violations: tuple[Violation, ...] = ()
    memory: MemoryEstimate | None = None
    time: StepTime | None = None

    @property
    def valid(self) -> bool:
        return not self.violations

    @property
    def fits(self) -> bool:
        return self.valid and self.memory is not None and self.memory.fits

    def reason(self) -> str:
        if self.violations:
            return self.violations[0].reason
        if self.memory and not self.memory.host_fits:
            worst = self.memory.host_worst
            return (f"offloaded optimizer state does not fit in host memory on stage {worst.stage} "
                    f"({worst.host_offload / 1024**3:.0f} GiB per GPU)")
        if self.memory and not self.memory.fits:
            worst = self.memory.worst
            return f"out of memory on stage {worst.stage} (largest: {worst.largest()})"
        return "fits"


@dataclass
class PlanResult:
    job: Job
    cluster: ClusterShape
    fitting: list[LayoutVerdict] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)
    examples: dict[str, LayoutVerdict] = field(default_factory=dict)
    smallest_fit: ClusterShape | None = None
    # structures that only the global batch ruled out (a knob rule: MBS*DP or VPP's micro-batches per step)
    batch_bound: list[Layout] = field(default_factory=list)

    def reject(self, verdict: LayoutVerdict, key: str) -> None:
        self.rejected[key] += 1
        self.examples.setdefault(key, verdict)


def settle_param_gather(layout: Layout) -> Layout:
    """overlap_param_gather left open (None) becomes on wherever megatron allows it (distributed optimizer and
    overlapped gradient reduction). The engine dispatches the whole gather right after the optimizer step
    (workload/engine_megatron.py ParamGather), and so overlapped it was the faster within a node too: on 2 H200s,
    DP2 MBS 8, 0.6077 s against 0.6163 s a step (MoE proxy) and 0.3272 s against 0.3308 s (dense), paired runs
    (docs/benchmarks.md, 2026-11-30). megatron's own dispatch, a bucket at a time from the forward's pre-hooks,
    had been the slower within a node (0.624 s against 0.621 s). The gather's cost within and across nodes is
    steptime._grad_sync's."""
    if layout.overlap_param_gather is not None:
        return layout
    return replace(layout, overlap_param_gather=layout.param_gather_overlap)


def settle_sequence_parallel(job: Job, layout: Layout) -> Layout:
    """Sequence parallelism left open (None) is on wherever TP > 1 and the sequence (CP's slice of it) splits
    over TP (megatron-core scatters it along the sequence); otherwise TP runs without it. Given, it is judged."""
    if layout.sequence_parallel is not None:
        return layout
    return replace(layout, sequence_parallel=layout.tp > 1 and (job.seq_length // layout.cp) % layout.tp == 0)


def judge(
    params: ParamCount,
    job: Job,
    layout: Layout,
    cluster: ClusterShape,
    hardware: Hardware,
    margin: float = 0.10,
    engine: str = engines.DEFAULT_ENGINE,
) -> LayoutVerdict:
    """A layout's verdict: megatron-core's rules, then what `engine` runs (stepdeploy/data/engines.yaml), then
    memory and step time."""
    layout = engines.settle(engine, settle_sequence_parallel(job, settle_param_gather(layout)))
    broken = tuple(violations(job, layout))
    refused = None if broken else engines.refusal(engine, layout, job.model)
    if refused:
        broken = (Violation("engine", refused),)
    if broken:
        return LayoutVerdict(layout, broken)
    memory = estimate_memory(params, job, layout, cluster, margin)
    return LayoutVerdict(layout, (), memory, predict_step_time(params, job, layout, cluster, hardware))


def _divisors(n: int, upto: int) -> list[int]:
    """The divisors of `n` no larger than `upto`: the loop is bounded by the model (layers, experts), never by
    the GPU count (a cluster of a billion GPUs must not take a billion steps)."""
    return [d for d in range(1, min(n, upto) + 1) if n % d == 0]


def structures(spec: ModelSpec, world: int) -> Iterator[Layout]:
    """Every (TP, PP, VPP, CP, EP, ETP) the search tries; knobs are chosen per structure later."""
    moe = spec.moe is not None
    eps = [d for d in _divisors(world, spec.moe.num_experts) if spec.moe.num_experts % d == 0] if moe else [1]
    etps = [p for p in POWERS if p <= world] if moe else [1]
    pps = _divisors(world, spec.num_layers)
    tps = [p for p in POWERS if p <= world]
    for tp, pp, vpp, cp, ep, etp in product(tps, pps, (1, 2, 3, 4, 5), tps, eps, etps):
        if vpp > 1 and pp == 1:
            continue
        yield Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp)


def _knob_choices(structure: Layout, frugal: bool) -> Iterator[Layout]:
    """Every micro-batch size, recompute and AdamW implementation on the GPU (torch's foreach or fused kernels,
    ADAM_IMPLEMENTATIONS: each modelled in memory, memory.ADAM_STEP_BYTES_BY_IMPLEMENTATION, and in step time,
    steptime.OPTIMIZER_STEP_BYTES_BY_IMPLEMENTATION); then, with full recompute, the optimizer on the host
    (megatron-core's HybridDeviceOptimizer, whose host AdamW is the fused one whatever `optimizer` says). The fastest
    that fits wins; at equal time the earlier (foreach before fused: what most measured runs used)."""
    batches, recomputes = ((1,), ("full",)) if frugal else (MICRO_BATCHES, RECOMPUTE)
    for mbs, recompute, optimizer in product(batches, recomputes, ADAM_IMPLEMENTATIONS):
        yield replace(structure, mbs=mbs, recompute=recompute, optimizer=optimizer)
    for mbs in batches:
        yield replace(structure, mbs=mbs, recompute="full", optimizer_cpu_offload=True,
                      precision_aware_optimizer=True, optimizer="fused")


def _best_for_structure(
    params: ParamCount,
    job: Job,
    structure: Layout,
    cluster: ClusterShape,
    hardware: Hardware,
    margin: float,
    frugal: bool,
) -> LayoutVerdict:
    best: LayoutVerdict | None = None
    tightest: LayoutVerdict | None = None
    invalid: LayoutVerdict | None = None
    for layout in _knob_choices(structure, frugal):
        verdict = judge(params, job, layout, cluster, hardware, margin)
        if not verdict.valid:
            if invalid is None and verdict.violations[0].rule not in KNOB_RULES:
                return verdict  # structural: no knob repairs it
            invalid = invalid or verdict
            continue
        if verdict.fits and (best is None or _speed(verdict) > _speed(best)):
            best = verdict
        elif not verdict.fits and (tightest is None or _overflow(verdict) < _overflow(tightest)):
            tightest = verdict
    return best or tightest or invalid  # type: ignore[return-value]


def _speed(verdict: LayoutVerdict) -> float:
    return verdict.time.tokens_per_second if verdict.time else 0.0


def _overflow(verdict: LayoutVerdict) -> float:
    return verdict.memory.overflow if verdict.memory else float("inf")


def search(
    spec: ModelSpec,
    cluster: ClusterShape,
    hardware: Hardware,
    seq_length: int,
    global_batch: int,
    margin: float = 0.10,
    frugal: bool = False,
) -> PlanResult:
    params = count_parameters(spec)
    job = Job(spec, seq_length, global_batch, cluster.world)
    result = PlanResult(job, cluster)
    for structure in structures(spec, cluster.world):
        verdict = _best_for_structure(params, job, structure, cluster, hardware, margin, frugal)
        if verdict.fits:
            result.fitting.append(verdict)
        elif verdict.violations:
            result.reject(verdict, verdict.violations[0].rule)
            if verdict.violations[0].rule in KNOB_RULES:
                result.batch_bound.append(structure)
        elif verdict.memory is not None and not verdict.memory.host_fits:
            result.reject(verdict, "host-memory")
        else:
            result.reject(verdict, "memory")
    result.fitting.sort(key=_speed, reverse=True)
    return result


@dataclass(frozen=True)
class BatchCap:
    """The global batch caps data parallelism: every DP divides the GPU count, so a global batch that is a
    multiple of it (`uncapped_batch`) lets every layout run; at that batch `uncapped` (a layout the job's batch
    ruled out) beats the best layout the job's batch allows (`capped`, None when none fits)."""

    global_batch: int
    uncapped_batch: int
    world: int
    capped: LayoutVerdict | None
    capped_dp: int | None
    uncapped: LayoutVerdict
    uncapped_dp: int


def batch_cap(spec: ModelSpec, result: PlanResult, hardware: Hardware, margin: float = 0.10) -> BatchCap | None:
    """What the global batch costs when it caps data parallelism: the layouts it ruled out, judged again at the
    smallest global batch that is a multiple of the GPU count; None when none of them fits there, or none beats
    the best layout the job's own batch allows (in MFU: per-GPU work, comparable across batches)."""
    job, cluster = result.job, result.cluster
    uncapped_batch = -(-job.global_batch_size // cluster.world) * cluster.world
    if not result.batch_bound or uncapped_batch == job.global_batch_size:
        return None
    params, bigger = count_parameters(spec), replace(job, global_batch_size=uncapped_batch)
    verdicts = [_best_for_structure(params, bigger, structure, cluster, hardware, margin, False)
                for structure in result.batch_bound]
    best = max((v for v in verdicts if v.fits), key=lambda v: v.time.mfu if v.time else 0.0, default=None)
    capped = result.fitting[0] if result.fitting else None
    if best is None or best.time is None:
        return None
    if capped is not None and capped.time is not None and capped.time.mfu >= best.time.mfu:
        return None
    return BatchCap(job.global_batch_size, uncapped_batch, cluster.world, capped,
                    job.dp(capped.layout) if capped else None, best, bigger.dp(best.layout))


def smallest_fitting_cluster(
    spec: ModelSpec,
    cluster: ClusterShape,
    hardware: Hardware,
    seq_length: int,
    global_batch: int,
    margin: float = 0.10,
    max_gpus: int = 4096,
) -> ClusterShape | None:
    """The fewest nodes of the same kind on which some layout fits (memory-frugal knobs only)."""

    def fits(nodes: int) -> bool:
        bigger = cluster.with_nodes(nodes)
        return bool(search(spec, bigger, hardware, seq_length, global_batch, margin, frugal=True).fitting)

    tried = cluster.nodes
    for nodes in _node_counts(cluster, max_gpus):
        if fits(nodes):
            # The coarse steps may have jumped over a smaller size: walk back up from the last miss.
            first = next((n for n in range(tried + 1, nodes) if fits(n)), nodes)
            return cluster.with_nodes(first)
        tried = nodes
    return None


def _node_counts(cluster: ClusterShape, max_gpus: int) -> list[int]:
    limit = max_gpus // cluster.gpus_per_node
    counts = set(range(cluster.nodes + 1, min(limit, 16) + 1))
    counts |= {n for n in range(16, limit + 1, 8)}
    return sorted(n for n in counts if n > cluster.nodes)
