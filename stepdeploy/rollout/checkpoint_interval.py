"""`--checkpoint-interval auto`: the inputs of plan/checkpoint.py's Young/Daly interval, gathered where the
controller has them, each saying where it came from.

- the save stall: measured by the target's earlier attempts (the `save` lines of their out/phases.jsonl: the torch
  engine saves at the end of every attempt), else the planner's checkpoint size at a stated write bandwidth;
- the step time: the warm-up's steady step, else the planner's prediction for the target's layout, else assumed;
- the MTBF: `--mtbf`, else Llama 3's per-GPU rate times the cluster's GPUs (a CPU node counts as one).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepdeploy.catalog import load_model
from stepdeploy.errors import StepdeployError
from stepdeploy.inventory.model import Cluster
from stepdeploy.plan import checkpoint
from stepdeploy.plan.params import count_parameters
from stepdeploy.rollout.attempt import read_phases
from stepdeploy.rollout.config import RolloutConfig
from stepdeploy.rollout.ladder import slots_per_node, sub_cluster, target_rung

if TYPE_CHECKING:
    from stepdeploy.rollout.service import AttemptService

DEFAULT_STEP_S = 1.0  # no warm-up measured and no GPU plan (a soak run alone on CPU nodes): an assumption, said so


def gpus(cluster: Cluster) -> int:
    """What the default MTBF scales with: every GPU of the cluster, or one per CPU node."""
    return len(cluster.nodes) * slots_per_node(cluster)


def predicted_step(cluster: Cluster, config: RolloutConfig) -> tuple[float | None, str]:
    """The planner's step time for the target on every node, or None and why (CPU nodes have no plan)."""
    if not cluster.nodes[0].gpus_per_node:
        return None, "CPU nodes: no plan"
    from stepdeploy.render.build import choose_layout  # the planner's search: only when a GPU plan is wanted

    spec = load_model(config.model)
    sub = sub_cluster(cluster, target_rung(cluster, config.model).nodes)
    try:
        _layout, summary = choose_layout(sub, spec, config.layout, config.seq_length or spec.training.seq_length,
                                         config.global_batch_size or spec.training.global_batch_size)
    except StepdeployError as exc:
        return None, f"no plan: {exc.message}"
    return summary.get("predicted_step_s"), "the planner's prediction"


def planned_step(cluster: Cluster, config: RolloutConfig) -> tuple[float, str]:
    predicted, why = predicted_step(cluster, config)
    if predicted:
        return float(predicted), why
    return DEFAULT_STEP_S, f"assumed ({DEFAULT_STEP_S} s: no warm-up measured; {why})"


def estimated_save(cluster: Cluster, model: str) -> tuple[float, str]:
    params = count_parameters(load_model(model)).total
    return checkpoint.estimated_save(params, cluster.nodes[0].gpus_per_node or 0, len(cluster.nodes))


def save_durations(phase_lines: list[dict[str, Any]]) -> list[float]:
    return [float(p["time"]) - float(p["began"]) for p in phase_lines
            if p.get("phase") == "save" and isinstance(p.get("began"), int | float)]


def measured_save(r: AttemptService) -> tuple[float, str] | None:
    """The median save stall of the target's attempts so far (the warm-up's, the scale ladder's target rung)."""
    runs = {a["detail"]["local_run"]: None for a in r.attempts(None)  # a soak's attempts share one
            if (a["detail"].get("rung") or {}).get("model") == r.config.model and a["detail"].get("local_run")}
    durations = [d for run in runs for d in save_durations(read_phases(Path(run) / "fetched"))]
    if not durations:
        return None
    return statistics.median(durations), f"measured: the median of {len(durations)} save(s) of the target so far"


def for_soak(r: AttemptService, step_s: float, step_source: str) -> checkpoint.CheckpointInterval:
    """The interval the soak renders with (measured inputs where the earlier stages have them)."""
    save_s, save_source = measured_save(r) or estimated_save(r.cluster, r.config.model)
    return checkpoint.resolve(max(save_s, 1e-3), save_source, step_s, step_source, gpus(r.cluster), r.config.mtbf_s)


def for_dry_run(cluster: Cluster, config: RolloutConfig) -> checkpoint.CheckpointInterval:
    """What the soak would resolve without measurements (the dry run starts nothing): the planner's figures."""
    save_s, save_source = estimated_save(cluster, config.model)
    step_s, step_source = planned_step(cluster, config)
    return checkpoint.resolve(save_s, save_source, step_s, step_source, gpus(cluster), config.mtbf_s)


def longer_than_the_soak(interval: checkpoint.CheckpointInterval, expected_iterations: int) -> str | None:
    """A warning when no checkpoint would be saved before the soak ends (a restart would start over)."""
    if interval.iterations <= expected_iterations:
        return None
    return (f"the interval is longer than the soak's ~{expected_iterations:,} iterations: no checkpoint before it "
            "ends (a restart would start from the beginning); a soak that tests recovery wants --mtbf or an integer "
            "--checkpoint-interval")
