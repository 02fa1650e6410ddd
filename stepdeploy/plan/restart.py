"""Restart time and goodput on paper (issue 37 item 5): what one failure costs a job of a given size, from the parts
measured on one GPU, and what share of the time failures at Llama 3's rate leave for training. Pure: numbers in,
numbers out.

A restart is the sum of its parts, each a measured constant or a measured rate times the job's size:

    detection + stop + launch + imports and process group (grows with the ranks) + model build (grows with the
    parameters a GPU holds) + state restore (the state a GPU holds / the read rate) + the first step (a steady step
    plus the first step's extra)

Goodput, first order (Young 1974; checkpoint.py): with M the job's MTBF, delta the save stall and tau the computing
time between saves,

    lost = delta / tau  (saves)  +  tau / (2 M)  (work redone since the last save)  +  R / M  (restarts)
    goodput = 1 - lost

Measured parts (docs/benchmarks.md, "Issue 37: restart time"): the dense proxy (0.74B, 10.3 GB of state on one
GPU) and the MoE proxy (3.5B, 49.8 GB) restarted by `rollout run --executor local` on an H100, the ranks started by
stepdeploy's launcher (launch_ranks.py) and the checkpoint read straight from its files (ckpt_read.py): kill to the
first new step 7.26 s for the dense proxy, the median of 3 kills (call BB: detection 0.56 s, stop and restart
decided 0.18 s, launch 0.11 s, imports + process group 1.32 s, model build 2.70 s of which megatron-core's import
~2.3 s, the read 10.3 GB at 12.1-12.6 GB/s, the first step 0.65-0.78 s above a steady one), 12.46 s for the MoE
proxy's one kill (call BC: model build 2.76 s, the read 49.8 GB at 19.2 GB/s, the first step 1.17 s above a
steady one): with no random initialization the build hardly grows with the parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from stepdeploy.plan.checkpoint import LLAMA3_SOURCE, daly_interval_s, default_mtbf_s, estimated_save
from stepdeploy.plan.memory import WEIGHT_BYTES

GB = 1e9
# Each part: (value, where it comes from). Seconds unless named otherwise.
DETECTION_S = 0.7  # kill to the controller's `detected` over SSH polled every 0.5 s (2-node sim cluster,
# bench/fault_matrix.py, 2026-12-06; 2.3 s at the former 2 s poll); 0.57-0.69 s with the local executor (AX-BA)
STOP_S = 0.2  # stop the survivors, diagnose, decide the restart (median of 4 kills, calls BB-BC: 0.18-0.73 s)
LAUNCH_S = 0.11  # the controller's launch to the rank's first line (4 kills, BB-BC: 0.11-0.12 s); nodes in parallel
IMPORTS_S = 1.32  # torch's import and a one-rank process group (median of 4 kills, BB-BC: 1.30-3.32 s)
# Not modelled: after the kill of a large rank the new one's start waits longer (the MoE proxy 3.32 s, BC; the slice
# 5.59 s on an H200, BD, whose restart took 17.90 s against the 11.2 s these parts give), as does its first step.
# The process group's rendezvous grows with the ranks (every rank connects to the TCPStore and NCCL's bootstrap
# ring exchanges addresses): assumed 1 ms per rank, i.e. ~8 s for 8,192 ranks. Not measured beyond one node.
PROCESS_GROUP_S_PER_RANK = 1e-3
# model build: megatron-core's import and the build without random initialization, from two models on the H100:
# 2.70 s for 0.74B parameters a GPU (the median of 3, BB), 2.76 s for 3.5B (BC)
BUILD_BASE_S = 2.68
BUILD_S_PER_PARAM = 0.021e-9
# one rank's read straight from the files: 10.3 GB at 12.1-12.6 GB/s (BB), 49.8 GB at 19.2 GB/s (BC): the lower
READ_BYTES_PER_S_PER_GPU = 12.2 * GB
# A node's read from shared storage, shared by its ranks: assumed one 100 Gb/s storage link (12.5 GB/s), so 8 ranks
# read at ~1.56 GB/s each. Not measured on a multi-node cluster.
NODE_READ_BYTES_PER_S = 12.5 * GB
FIRST_STEP_EXTRA_S = 1.0  # the first step above a steady one, compile cache warm (BB-BC: 0.65-1.17 s)

ASSUMPTIONS = (
    f"detection {DETECTION_S} s over SSH, stop and restart decision {STOP_S} s, launch {LAUNCH_S} s (nodes "
    "launched in parallel): measured on one GPU with the local executor (H100, calls BB-BC; detection over SSH "
    "on the simulated cluster), docs/benchmarks.md",
    f"imports {IMPORTS_S} s (measured) + process group {PROCESS_GROUP_S_PER_RANK * 1e3:g} ms per rank (assumed: "
    "TCPStore and NCCL bootstrap grow with the ranks; not measured beyond one node)",
    f"model build {BUILD_BASE_S} s + {BUILD_S_PER_PARAM * 1e9:.3f} s per billion parameters a GPU holds (measured: "
    "2.70 s for the 0.74B dense proxy, 2.76 s for the 3.5B MoE proxy; megatron-core's import is most of it)",
    f"state restore: the weights and optimizer state a GPU holds (the planner's memory model) at min("
    f"{READ_BYTES_PER_S_PER_GPU / GB:g} GB/s per rank (measured, read straight from the files), "
    f"{NODE_READ_BYTES_PER_S / GB:g} GB/s per node / its GPUs (assumed storage link))",
    f"first step: the planner's step + {FIRST_STEP_EXTRA_S} s (measured, compile cache warm)",
    f"failures: {LLAMA3_SOURCE}, per GPU, times the job's GPUs; every failure restarts the whole job",
    "checkpoint interval: Young/Daly from the planner's save stall (or as given); goodput = 1 - save stalls/tau - "
    "tau/(2 MTBF) - restart/MTBF (first order)",
    "other scales: the same layout with more data parallelism (the global batch grows with it): the same step, "
    "the distributed optimizer's shard shrinks with DP",
    "not modelled, so low for a GPU that is nearly full: after a kill, a rank that held much GPU memory starts "
    f"slower (imports and process group 3.32 s at 65.6 GiB, 5.59 s at 107 GiB, against {IMPORTS_S} s at a first "
    "start) and takes a longer first step (1.2 and 3.4 s above a steady one); the Step-3.5-Flash slice on one "
    "H200 measured 17.9 s where these parts give 11.2 s (call BD; the cause is not measured yet)",
)


@dataclass(frozen=True)
class RestartEstimate:
    nodes: int
    gpus_per_node: int
    gpus: int
    state_bytes_per_gpu: float
    parts: dict[str, float]  # seconds, in the order a restart runs them
    restart_s: float
    mtbf_s: float
    failures_per_day: float
    interval_s: float  # computing time between saves
    save_s: float
    lost: dict[str, float] = field(default_factory=dict)  # fractions of the time: saves, redone, restarts
    goodput: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        parts = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}" for name, seconds in self.parts.items())
        return (f"{self.nodes} x {self.gpus_per_node} GPUs: restart {self.restart_s:.1f} s ({parts}; "
                f"{self.state_bytes_per_gpu / GB:.1f} GB of state per GPU); {self.failures_per_day:.2f} failures a "
                f"day; a save every {self.interval_s:,.0f} s of {self.save_s:.3g} s; goodput {self.goodput:.2%}")


def restart_parts(gpus: int, gpus_per_node: int, params_per_gpu: float, state_bytes_per_gpu: float,
                  step_s: float) -> dict[str, float]:
    """Seconds of each part of one restart of a job of `gpus` GPUs."""
    if gpus < 1 or gpus_per_node < 1 or step_s <= 0:
        raise ValueError(f"a restart needs GPUs and a positive step (got {gpus}, {gpus_per_node}, {step_s})")
    read_rate = min(READ_BYTES_PER_S_PER_GPU, NODE_READ_BYTES_PER_S / min(gpus_per_node, gpus))
    return {
        "detection": DETECTION_S,
        "stop": STOP_S,
        "launch": LAUNCH_S,
        "imports_and_process_group": IMPORTS_S + PROCESS_GROUP_S_PER_RANK * gpus,
        "model_build": BUILD_BASE_S + BUILD_S_PER_PARAM * params_per_gpu,
        "state_restore": state_bytes_per_gpu / read_rate,
        "first_step": step_s + FIRST_STEP_EXTRA_S,
    }


def lost_fractions(restart_s: float, save_s: float, interval_s: float, mtbf_s: float) -> dict[str, float]:
    """First-order shares of the time lost to saves, to work redone since the last save, and to restarts."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"the interval and the MTBF must be positive (got {interval_s}, {mtbf_s})")
    return {"saves": save_s / interval_s, "redone": interval_s / (2.0 * mtbf_s), "restarts": restart_s / mtbf_s}


def estimate(nodes: int, gpus_per_node: int, params_per_gpu: float, state_bytes_per_gpu: float, step_s: float,
             save_s: float, mtbf_s: float | None = None, interval_s: float | None = None) -> RestartEstimate:
    """Restart time and goodput of a job on `nodes` x `gpus_per_node` GPUs. `mtbf_s` None: Llama 3's rate for the
    GPUs; `interval_s` None: Daly's optimum from the save stall and the MTBF."""
    gpus = nodes * gpus_per_node
    parts = restart_parts(gpus, gpus_per_node, params_per_gpu, state_bytes_per_gpu, step_s)
    restart_s = sum(parts.values())
    mtbf = mtbf_s if mtbf_s is not None else default_mtbf_s(gpus)
    tau = interval_s if interval_s is not None else daly_interval_s(save_s, mtbf)
    lost = lost_fractions(restart_s, save_s, tau, mtbf)
    return RestartEstimate(nodes, gpus_per_node, gpus, state_bytes_per_gpu, parts, restart_s, mtbf,
                           86400.0 / mtbf, tau, save_s, lost, max(0.0, 1.0 - sum(lost.values())))



TARGET_GPUS = (16 * 8, 1024 * 8)  # issue 37's target scales: 16 x 8 and 1,024 x 8 GPUs, in nodes of the plan's kind


def layout_estimates(total_params: int, weights_bytes: float, optimizer_bytes: float, distributed_optimizer: bool,
                     nodes: int, gpus_per_node: int, step_s: float, mtbf_s: float | None = None,
                     targets: tuple[int, ...] = TARGET_GPUS) -> list[RestartEstimate]:
    """The estimate for a layout at its own cluster and at the target node counts (of the same node): the weights a
    GPU holds stay, the distributed optimizer's shard shrinks with the data parallelism. `weights_bytes` and
    `optimizer_bytes` are one GPU's (bf16 weights; fp32 master and moments, on the GPU or offloaded); `mtbf_s`, when
    given, is the MTBF of `nodes` nodes, scaled by the GPU count elsewhere."""
    estimates = []
    for count in sorted({nodes, *(max(1, gpus // gpus_per_node) for gpus in targets)}):
        shard = optimizer_bytes * (nodes / count if distributed_optimizer else 1.0)
        save_s, _ = estimated_save(total_params, gpus_per_node, count)
        mtbf = mtbf_s * nodes / count if mtbf_s is not None else None  # a given MTBF is the plan's cluster's
        estimates.append(estimate(count, gpus_per_node, weights_bytes / WEIGHT_BYTES, weights_bytes + shard, step_s,
                                  save_s, mtbf))
    return estimates


__all__ = ["ASSUMPTIONS", "TARGET_GPUS", "RestartEstimate", "estimate", "layout_estimates", "lost_fractions",
           "restart_parts"]
