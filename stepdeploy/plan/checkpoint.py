"""How often to checkpoint: the Young/Daly optimum interval from the save stall and the cluster's mean time between
failures (pure: numbers in, numbers out).

    Young, J. W. (1974). A first order approximation to the optimum checkpoint interval. Communications of the ACM
        17(9), 530-531: tau = sqrt(2 * delta * M).
    Daly, J. T. (2006). A higher order estimate of the optimum checkpoint interval for restart dumps. Future
        Generation Computer Systems 22(3), 303-312, doi:10.1016/j.future.2004.11.016: for delta < 2M,
        tau = sqrt(2 * delta * M) * (1 + sqrt(delta / (2M)) / 3 + (delta / (2M)) / 9) - delta; else tau = M
        (its Figs. 3-5: delta 5 min and M 24 h, 6 h, 15 min give 117, 57 and 9.1 min).

delta is the time a save blocks training, M the mean time between failures of the whole job, tau the computing time
between two saves. The default M comes from Llama 3's published interruption rate (Meta, "The Llama 3 Herd of
Models", 2024, section 3.3.4: 419 unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs),
taken per GPU and scaled to the cluster's GPU count (a CPU node counts as one).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from stepdeploy.plan.memory import OPTIMIZER_BYTES, WEIGHT_BYTES

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_SOURCE = ("Llama 3's rate: 419 unexpected interruptions in 54 days on 16,384 GPUs (The Llama 3 Herd of "
                 "Models, 2024, section 3.3.4)")
# A GPU's mean time between interruptions at that rate (~5.8 years); a job on G GPUs fails G times as often.
GPU_MTBF_S = LLAMA3_DAYS * 86400.0 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS

# What one node writes per second while a save blocks the step: docs/benchmarks.md, call M on the H200 machine,
# the Step-3.5-Flash slice's 48.1 GB checkpoint blocked training 62 s (~0.78 GB/s); the 0.7B proxy's ~10 GB saves
# blocked 15-24 s (0.43-0.69 GB/s). Assumed for a cluster nothing has been measured on yet.
WRITE_BYTES_PER_S = 0.8e9
WRITE_SOURCE = "the planner's checkpoint size at 0.8 GB/s per node (measured on an H200 node: docs/benchmarks.md)"
# Bytes a checkpoint holds per parameter. megatron: bf16 weights + fp32 master copy and Adam's two moments (the
# distributed optimizer's state, spread over the ranks: each node writes its share). torch engine: fp32 weights
# and AdamW's two moments, written whole by every node.
MEGATRON_BYTES_PER_PARAM = WEIGHT_BYTES + OPTIMIZER_BYTES
TORCH_BYTES_PER_PARAM = 12


def default_mtbf_s(gpus: int) -> float:
    """The job's mean time between failures at Llama 3's per-GPU rate, for `gpus` GPUs (CPU nodes: one each)."""
    if gpus < 1:
        raise ValueError(f"a job needs at least one GPU (or CPU node), not {gpus}")
    return GPU_MTBF_S / gpus


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young (1974): tau = sqrt(2 delta M)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly (2006): Young's interval with the higher-order terms; M itself when delta >= 2M."""
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_s / (2.0 * mtbf_s)
    return young_interval_s(save_s, mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def checkpoint_bytes_per_node(params: int, gpus_per_node: int, nodes: int) -> float:
    """What one node writes per save: megatron (GPU nodes) spreads one copy over the nodes, the torch engine
    (CPU nodes) writes the whole state on every node."""
    if gpus_per_node:
        return params * MEGATRON_BYTES_PER_PARAM / max(nodes, 1)
    return float(params * TORCH_BYTES_PER_PARAM)


def estimated_save_s(bytes_per_node: float) -> float:
    return bytes_per_node / WRITE_BYTES_PER_S


def estimated_save(params: int, gpus_per_node: int, nodes: int) -> tuple[float, str]:
    """(seconds a save blocks, where the figure comes from) for a model of `params` parameters."""
    per_node = checkpoint_bytes_per_node(params, gpus_per_node, nodes)
    return estimated_save_s(per_node), f"estimated: {per_node / 1e9:.3g} GB per node, {WRITE_SOURCE}"


@dataclass(frozen=True)
class CheckpointInterval:
    """The resolved interval and every input it came from (each input says where it came from)."""

    iterations: int
    interval_s: float  # Daly's tau: computing time between saves
    young_s: float
    save_s: float
    save_source: str
    mtbf_s: float
    mtbf_source: str
    step_s: float
    step_source: str
    gpus: int
    overhead: float  # first order: delta / tau + tau / 2M, the share of time saves and redone work cost

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"every {self.iterations:,} iteration(s) (~{_duration(self.iterations * self.step_s)}; Young/Daly "
                f"tau {self.interval_s:,.0f} s from a save stall of {self.save_s:.3g} s, {self.save_source}, and an "
                f"MTBF of {_duration(self.mtbf_s)} for {self.gpus} GPU(s), {self.mtbf_source}; step "
                f"{self.step_s:.3g} s, {self.step_source}; expected overhead {self.overhead:.1%})")


def resolve(save_s: float, save_source: str, step_s: float, step_source: str, gpus: int,
            mtbf_s: float | None = None) -> CheckpointInterval:
    """Daly's interval in iterations (rounded, at least 1). `mtbf_s` None: Llama 3's rate for `gpus`."""
    if save_s <= 0 or step_s <= 0:
        raise ValueError(f"the save stall and the step time must be positive (got {save_s}, {step_s})")
    mtbf, mtbf_source = (mtbf_s, "given (--mtbf)") if mtbf_s is not None else (default_mtbf_s(gpus), LLAMA3_SOURCE)
    tau = daly_interval_s(save_s, mtbf)
    iterations = max(1, round(tau / step_s))
    actual = iterations * step_s
    return CheckpointInterval(iterations, tau, young_interval_s(save_s, mtbf), save_s, save_source, mtbf,
                              mtbf_source, step_s, step_source, gpus, save_s / actual + actual / (2.0 * mtbf))


def _duration(seconds: float) -> str:
    for unit, size in (("years", 365.25 * 86400.0), ("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"
