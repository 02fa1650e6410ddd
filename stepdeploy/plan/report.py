"""Turn plan results into rich tables and JSON-ready dicts. Pure: no printing here."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

from rich.table import Table

from stepdeploy.catalog import GIB
from stepdeploy.plan import engines
from stepdeploy.plan.constraints import RULES
from stepdeploy.plan.layout import Layout, stage_layer_counts
from stepdeploy.plan.memory import COMPONENTS, MemoryEstimate
from stepdeploy.plan.params import LayerParams, ParamCount
from stepdeploy.plan.restart import ASSUMPTIONS, RestartEstimate
from stepdeploy.plan.search import BatchCap, LayoutVerdict, PlanResult

RULE_SUMMARY = {rule.name: rule.summary for rule in RULES} | {
    "memory": "does not fit in GPU memory",
    "host-memory": "offloaded optimizer state does not fit in host memory",
    "engine": "the engine does not run it (stepdeploy/data/engines.yaml)",
}


def gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def billions(value: float) -> str:
    return f"{value / 1e9:.3f}B"


def adam_implementation(layout: Layout) -> str:
    """The AdamW kernels the plan's memory and time assume: under optimizer CPU offload megatron-core's
    HybridDeviceOptimizer steps torch's AdamW with fused=True on the host whatever `optimizer` says."""
    return "fused" if layout.optimizer_cpu_offload else layout.optimizer


def optimizer_assumed(layout: Layout) -> dict[str, str]:
    """What `plan` says it assumed of the optimizer (issue 22), in --json and under the step time."""
    implementation = adam_implementation(layout)
    kernels = {"foreach": "foreach kernels", "fused": "fused kernel"}[implementation]
    offload = layout.optimizer_cpu_offload
    where = "on the host (megatron-core HybridDeviceOptimizer, optimizer CPU offload)" if offload else "on the GPU"
    return {"implementation": implementation, "device": "host" if offload else "gpu",
            "summary": f"torch AdamW, {kernels}, {where}"}


def optimizer_line(layout: Layout) -> str:
    """The line under the ranking: which AdamW the first layout uses, and that every layout was ranked with each."""
    return (f"Optimizer of the first layout: {optimizer_assumed(layout)['summary']} (every layout is ranked with "
            "torch's foreach and fused AdamW on the GPU, and with the optimizer offloaded to the host)")


def _knobs(verdict: LayoutVerdict) -> str:
    layout = verdict.layout
    extra = ["offload"] if layout.optimizer_cpu_offload else []
    extra += [f"{adam_implementation(layout)}-adam"]
    extra += [] if layout.distributed_optimizer else ["no-dist-opt"]
    return " ".join([layout.recompute, *extra])


def ranking_table(result: PlanResult, top: int) -> Table:
    table = Table(title=f"Best layouts on {result.cluster.describe()}")
    for name in (
        "TP",
        "PP",
        "VPP",
        "CP",
        "EP",
        "ETP",
        "DP",
        "MBS",
        "recompute",
        "GiB/GPU",
        "w/g/opt/act GiB",
        "step s",
        "MFU",
        "tok/s",
    ):
        table.add_column(name, justify="right")
    job = result.job
    for verdict in result.fitting[:top]:
        lay, mem, time = verdict.layout, verdict.memory, verdict.time
        assert mem is not None and time is not None
        parts = mem.worst.components
        split = "/".join(gib(parts[key]) for key in ("weights", "gradients", "optimizer", "activations"))
        table.add_row(
            *map(str, (lay.tp, lay.pp, lay.vpp, lay.cp, lay.ep, lay.etp, job.dp(lay), lay.mbs)),
            _knobs(verdict),
            gib(mem.worst.total),
            split,
            f"{time.seconds:.2f}",
            f"{time.mfu:.1%}",
            f"{time.tokens_per_second:,.0f}",
        )
    return table


def rejection_table(result: PlanResult) -> Table:
    table = Table(title="Rejected layouts, by the first rule they break")
    for name, justify in (("count", "right"), ("rule", "left"), ("example", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for key, count in result.rejected.most_common():
        example = result.examples[key]
        table.add_row(str(count), RULE_SUMMARY.get(key, key), f"{example.layout.short()}: {example.reason()}")
    return table


def memory_table(memory: MemoryEstimate) -> Table:
    table = Table(
        title=f"Memory per GPU (GiB) by pipeline stage; budget {gib(memory.budget)} of "
        f"{gib(memory.capacity)} ({memory.margin:.0%} margin)"
    )
    table.add_column("component")
    for stage in memory.stages:
        table.add_column(f"stage {stage.stage} ({stage.layers} layers)", justify="right")
    for name in COMPONENTS:
        table.add_row(name, *(gib(stage.components[name]) for stage in memory.stages))
    table.add_row("torch allocated", *(gib(stage.torch_allocated) for stage in memory.stages))
    table.add_row("total", *(gib(stage.total) for stage in memory.stages))
    return table


def _layer_kind(layer: LayerParams) -> str:
    shape = layer.shape
    window = f", window {shape.window}" if shape.window else ""
    prefix = "MTP: " if layer.mtp_extra else ""
    return f"{prefix}{shape.attention} attention ({shape.num_heads} heads{window}) + {shape.ffn} FFN"


def _ranges(indices: list[int]) -> str:
    steps = {b - a for a, b in itertools.pairwise(indices)}
    if len(indices) > 2 and len(steps) == 1:
        step = steps.pop()
        return f"{indices[0]}-{indices[-1]}" + (f" every {step}" if step > 1 else "")
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def explain_table(params: ParamCount) -> Table:
    table = Table(title=f"{params.model}: parameters per layer kind")
    for name in (
        "layers",
        "kind",
        "attention",
        "FFN/experts",
        "router",
        "norms (+MTP proj)",
        "per layer",
        "active/layer",
        "sum",
    ):
        table.add_column(name, justify="left" if name in ("layers", "kind") else "right", overflow="fold")
    groups: dict[str, list[tuple[int, LayerParams]]] = defaultdict(list)
    for index, layer in enumerate(params.all_layers):
        groups[_layer_kind(layer)].append((index, layer))
    for kind, members in groups.items():
        layer = members[0][1]
        ffn = layer.dense_mlp + layer.experts_total + layer.shared_expert
        where = f"{len(members)}: {_ranges([index for index, _ in members])}"
        table.add_row(
            where,
            kind,
            billions(layer.attention),
            billions(ffn),
            f"{layer.router:,}",
            f"{layer.norms + layer.mtp_extra:,}",
            billions(layer.total),
            billions(layer.active),
            billions(layer.total * len(members)),
        )
    tables = params.embedding + params.position_embedding + params.output_layer + params.final_norm
    table.add_row(
        "", "embedding + output + final norm", "", "", "", "", billions(tables), "", billions(tables)
    )
    return table


def explain_summary(params: ParamCount) -> list[str]:
    lines = [
        f"total {billions(params.total)} = main model {billions(params.main_model)} "
        f"+ MTP {billions(params.total - params.main_model)}",
        f"active per token {billions(params.active)} (main model; "
        f"{billions(params.active - params.embedding - params.output_layer)} without embedding and output)",
        f"routed experts {billions(params.experts)}",
    ]
    return lines


def verdict_dict(verdict: LayoutVerdict, result_job: Any) -> dict[str, Any]:
    lay = verdict.layout
    counts = stage_layer_counts(result_job.model.num_layers, lay) if not verdict.violations else None
    data: dict[str, Any] = {
        "layout": lay.__dict__ | {"dp": result_job.dp(lay), "edp": result_job.edp(lay)},
        "stage_layers": list(counts) if counts else None,
        "needs": engines.needs(result_job.model, lay),
        "valid": verdict.valid,
        "fits": verdict.fits,
        "reason": verdict.reason(),
        "violations": [v.__dict__ for v in verdict.violations],
        "optimizer_assumed": optimizer_assumed(lay),
    }
    if verdict.memory:
        data["memory_bytes"] = {
            "budget": verdict.memory.budget,
            "capacity": verdict.memory.capacity,
            "worst_stage": verdict.memory.worst.stage,
            "stages": [
                {
                    "stage": s.stage,
                    "layers": s.layers,
                    "total": s.total,
                    "torch_allocated": s.torch_allocated,
                    **s.components,
                }
                for s in verdict.memory.stages
            ],
        }
    if verdict.time:
        data["step"] = verdict.time.__dict__
    return data


def params_dict(params: ParamCount) -> dict[str, Any]:
    return {
        "total": params.total,
        "main_model": params.main_model,
        "active": params.active,
        "experts": params.experts,
        "embedding": params.embedding,
        "output_layer": params.output_layer,
        "layers": [
            {
                "label": layer.label,
                "attention": layer.shape.attention,
                "heads": layer.shape.num_heads,
                "ffn": layer.shape.ffn,
                "total": layer.total,
                "active": layer.active,
            }
            for layer in params.all_layers
        ],
    }


def result_dict(result: PlanResult, top: int) -> dict[str, Any]:
    return {
        "cluster": result.cluster.describe(),
        "world": result.cluster.world,
        "seq_length": result.job.seq_length,
        "global_batch_size": result.job.global_batch_size,
        "fitting": [verdict_dict(v, result.job) for v in result.fitting[:top]],
        "fitting_count": len(result.fitting),
        "rejected": {
            key: {
                "count": count,
                "rule": RULE_SUMMARY.get(key, key),
                "example": verdict_dict(result.examples[key], result.job),
            }
            for key, count in result.rejected.most_common()
        },
        "smallest_fit": result.smallest_fit.describe() if result.smallest_fit else None,
        "engine": {"name": engines.DEFAULT_ENGINE,
                   "context_parallel": engines.context_parallel_requirement(result.job.model),
                   "capabilities": engines.explain(engines.DEFAULT_ENGINE, result.job.model)},
    }


def shortfall(memory: MemoryEstimate) -> str:
    """Why a layout does not fit, in numbers: what its worst stage needs per GPU against what the GPU has (and
    the budget, the margin kept free), or the host memory its offloaded optimizer state needs."""
    if not memory.host_fits:
        worst, host = memory.host_worst, memory.host_capacity or 0.0
        return (f"its offloaded optimizer state needs {worst.host_offload / GIB:.2f} GiB of host memory per GPU "
                f"(stage {worst.stage}), the host has {host / GIB:.2f} GiB per GPU")
    worst = memory.worst
    return (f"needs {worst.total / GIB:.2f} GiB per GPU (stage {worst.stage}, largest: {worst.largest()}), the GPU "
            f"has {memory.capacity / GIB:.2f} GiB ({memory.budget / GIB:.2f} GiB with {memory.margin:.0%} kept free)")


def batch_cap_text(cap: BatchCap) -> str:
    """The warning `plan` prints when the global batch caps data parallelism."""
    now = (f"the best layout it allows, {cap.capped.layout.short()}, runs DP {cap.capped_dp} at MFU "
           f"{cap.capped.time.mfu:.1%}" if cap.capped is not None and cap.capped.time is not None
           else "no layout it allows fits")
    then = cap.uncapped.time.mfu if cap.uncapped.time else 0.0
    return (f"global batch {cap.global_batch} caps data parallelism on {cap.world:,} GPUs (MBS*DP must divide it): "
            f"{now}; --gbs {cap.uncapped_batch} (a multiple of the GPU count, so no DP is capped) would run "
            f"{cap.uncapped.layout.short()} at DP {cap.uncapped_dp}, MFU {then:.1%}")


def batch_cap_dict(cap: BatchCap | None) -> dict[str, Any] | None:
    if cap is None:
        return None
    capped = cap.capped
    return {
        "global_batch_size": cap.global_batch,
        "uncapped_global_batch_size": cap.uncapped_batch,
        "world": cap.world,
        "capped": None if capped is None else {
            "layout": capped.layout.short(), "dp": cap.capped_dp, "mfu": capped.time.mfu if capped.time else None},
        "uncapped": {"layout": cap.uncapped.layout.short(), "dp": cap.uncapped_dp,
                     "mfu": cap.uncapped.time.mfu if cap.uncapped.time else None},
        "message": batch_cap_text(cap),
    }


def restart_dict(estimates: list[RestartEstimate]) -> dict[str, Any] | None:
    """`plan --json`'s `restart`: restart time and goodput per scale (issue 37), with every assumption."""
    if not estimates:
        return None
    return {"estimates": [estimate.to_json() for estimate in estimates], "assumptions": list(ASSUMPTIONS)}


def restart_lines(estimates: list[RestartEstimate]) -> list[str]:
    """The plan's text: one line per scale, then the assumptions."""
    if not estimates:
        return []
    lines = ["Restart and goodput on paper (this layout; failures at Llama 3's rate, stepdeploy/plan/restart.py):"]
    lines += [f"  - {estimate.describe()}" for estimate in estimates]
    lines.append("  assuming:")
    lines += [f"  * {assumption}" for assumption in ASSUMPTIONS]
    return lines
