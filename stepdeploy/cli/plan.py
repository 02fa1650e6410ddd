"""`stepdeploy plan`: rank parallel layouts by memory and step time; say why the others cannot work.

Exit codes: 0 at least one layout fits (or the --layout given fits), 1 none does, 2 bad input — the inventory's stack
profile refused for its GPUs or for what the engine calls included (compat.stack_verdict: nothing is searched, nothing
listed as fitting; the same refusal as `render`'s).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import typer

from stepdeploy import compat
from stepdeploy.catalog import load_hardware, load_model
from stepdeploy.cli.common import finite_option
from stepdeploy.cli.output import console, emit_json, info, out, warn
from stepdeploy.cli.rollout import parse_mtbf
from stepdeploy.errors import EXIT_FAILED, BadInput
from stepdeploy.inventory import load_cluster
from stepdeploy.inventory.model import Cluster
from stepdeploy.plan import checkpoint, engines, report, restart
from stepdeploy.plan.cluster import MAX_GPUS_PER_NODE, MAX_NODES, ClusterShape, cluster_shape, shape_from_cluster
from stepdeploy.plan.layout import Job, Layout, check_sequence, parse_layout
from stepdeploy.plan.params import count_parameters
from stepdeploy.plan.search import BatchCap, PlanResult, batch_cap, judge, search, smallest_fitting_cluster

TABLE_WIDTH = 150  # wide tables stay readable when stdout is a pipe (rich assumes 80 columns there)


def _table(table: Any) -> None:
    if out.is_terminal:
        out.print(table)
        return
    console(file=sys.stdout, width=TABLE_WIDTH, highlight=False).print(table)


def _cluster(
    inventory: Cluster | None, nodes: int | None, gpus_per_node: int | None, gpu: str | None, link: str | None
) -> ClusterShape:
    if inventory:
        base = shape_from_cluster(inventory)
        given = cluster_shape(
            nodes or base.nodes,
            gpus_per_node or base.gpus_per_node,
            gpu or base.gpu.name,
            link or base.inter_node_link.name,
        )
        if given.inter_node_link != base.inter_node_link:
            return given  # another fabric than the inventory's: its HCAs say nothing about that one
        return replace(given, hcas_per_node=base.hcas_per_node, hca_rate_gbit=base.hca_rate_gbit)
    if not (nodes and gpus_per_node and gpu):
        raise BadInput(
            "say which cluster to plan for",
            hint="stepdeploy plan -m MODEL -i inventory/dgx.ini, or --nodes 2 --gpus-per-node 8 --gpu H200",
        )
    return cluster_shape(nodes, gpus_per_node, gpu, link or ("ib-400g" if gpus_per_node > 1 else "roce-200g"))


def _explain(model: str, as_json: bool) -> None:
    params = count_parameters(load_model(model))
    if as_json:
        emit_json(report.params_dict(params))
        return
    _table(report.explain_table(params))
    for line in report.explain_summary(params):
        out.print(line, markup=False)


def _print_layout_verdict(result_job: Job, verdict: Any, cluster: ClusterShape) -> None:
    out.print(f"Layout {verdict.layout.short()} on {cluster.describe()}: ", end="", markup=False)
    if verdict.violations:
        out.print("INVALID", markup=False)
        for violation in verdict.violations:
            out.print(f"  - [{violation.rule}] {violation.reason}", markup=False)
        return
    memory, time = verdict.memory, verdict.time
    word = "FITS" if memory.fits else "DOES NOT FIT"
    out.print(
        f"{word} (worst stage {memory.worst.stage}: {report.gib(memory.worst.total)} GiB of "
        f"{report.gib(memory.budget)} GiB budget; {report.gib(abs(memory.overflow))} GiB "
        f"{'over' if memory.overflow > 0 else 'to spare'}; largest component {memory.worst.largest()})",
        markup=False,
    )
    _table(report.memory_table(memory))
    out.print(
        f"step {time.seconds:.2f} s, MFU {time.mfu:.1%} of {time.peak_tflops:.0f} TFLOP/s, "
        f"{time.tokens_per_second:,.0f} tokens/s (DP={result_job.dp(verdict.layout)})",
        markup=False,
    )
    out.print(f"optimizer step {time.optimizer:.3f} s, assuming {report.optimizer_assumed(verdict.layout)['summary']}",
              markup=False)


def _print_result(result: PlanResult, top: int) -> None:
    if result.fitting:
        _table(report.ranking_table(result, top))
        out.print(report.optimizer_line(result.fitting[0].layout), markup=False)
    else:
        out.print(f"No layout fits on {result.cluster.describe()}.", markup=False)
    _table(report.rejection_table(result))
    if result.smallest_fit:
        out.print(
            f"Smallest cluster of this kind where a layout fits: {result.smallest_fit.describe()}",
            markup=False,
        )


def plan(
    model: str = typer.Option(..., "--model", "-m", help="Catalog model, e.g. step-3.5-flash."),
    inventory: str | None = typer.Option(None, "--inventory", "-i", help="Ansible inventory (INI/YAML)."),
    nodes: int | None = typer.Option(None, "--nodes", min=1, max=MAX_NODES, help="Node count (overrides the "
                                     "inventory)."),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", min=1, max=MAX_GPUS_PER_NODE,
                                             help="GPUs per node."),
    gpu: str | None = typer.Option(None, "--gpu", help="H100, H200, B200 or GB10."),
    link: str | None = typer.Option(
        None, "--link", help="Inter-node link: ib-400g, roce-200g, ethernet-tcp."
    ),
    seq: int | None = typer.Option(None, "--seq", min=1, help="Sequence length (default: the model's)."),
    gbs: int | None = typer.Option(None, "--gbs", min=1, help="Global batch size (default: the model's)."),
    layout: str | None = typer.Option(None, "--layout", help="Judge one layout: tp=8,pp=2,ep=4,mbs=1,..."),
    top: int = typer.Option(10, "--top", "-k", min=1, help="How many fitting layouts to show."),
    margin: float = finite_option(0.10, "--margin", min=0.0, max=0.9, help="Memory kept free, as a fraction."),
    explain: bool = typer.Option(False, "--explain", help="Show the per-layer parameter breakdown."),
    mtbf: str | None = typer.Option(None, "--mtbf", help="The job's mean time between failures for the checkpoint "
                                    "interval, e.g. 6h (default: Llama 3's failure rate per GPU x the GPUs)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON to stdout."),
) -> None:
    """Rank parallel layouts by memory and step time; say why every rejected one cannot work."""
    if explain and not (inventory or nodes):
        _explain(model, as_json)
        return
    mtbf_s = parse_mtbf(mtbf)
    spec, hardware = load_model(model), load_hardware()
    loaded = load_cluster(inventory) if inventory else None
    cluster = _cluster(loaded, nodes, gpus_per_node, gpu, link)
    if loaded is not None:  # the stack judged before anything is searched, as render judges it
        compat.require_stack(loaded, spec, engine=engines.DEFAULT_ENGINE, gpu=cluster.gpu.name)
    seq_length = seq if seq is not None else spec.training.seq_length
    check_sequence(spec, seq_length)
    global_batch = gbs if gbs is not None else spec.training.global_batch_size
    params = count_parameters(spec)
    if explain and not as_json:
        _explain(model, as_json)
    job = Job(spec, seq_length, global_batch, cluster.world)
    given = None
    if layout:
        given = judge(params, job, parse_layout(layout), cluster, hardware, margin)
    info(f"searching layouts for {spec.name} on {cluster.describe()} ...")
    result = search(spec, cluster, hardware, seq_length, global_batch, margin)
    if not result.fitting:
        info("nothing fits; looking for the smallest cluster of this kind that would ...")
        result.smallest_fit = smallest_fitting_cluster(
            spec, cluster, hardware, seq_length, global_batch, margin
        )
    interval = _checkpoint_interval(params.total, result, given, mtbf_s)
    restarts = _restart_estimates(params.total, result, given, mtbf_s)
    cap = batch_cap(spec, result, hardware, margin)
    if cap is not None:
        warn(report.batch_cap_text(cap))
    _emit(result, given, top, as_json, interval, cap, report.params_dict(params) if explain else None, restarts)
    if explain and not as_json:
        out.print(f"What the {engines.DEFAULT_ENGINE} engine runs (the layouts above are only those):", markup=False)
        for line in engines.explain(engines.DEFAULT_ENGINE, spec):
            out.print(f"  - {line}", markup=False)
    if not (given.fits if given else result.fitting):
        raise typer.Exit(EXIT_FAILED)


def _checkpoint_interval(params: int, result: PlanResult, given: Any, mtbf_s: float | None
                         ) -> checkpoint.CheckpointInterval | None:
    """What `rollout run --checkpoint-interval auto` would start from for the layout given (if it fits) or the
    best one: the planner's step time and checkpoint size, the cluster's GPUs."""
    verdict = given if given is not None and given.fits else next(iter(result.fitting), None)
    if verdict is None or verdict.time is None:
        return None
    shape = result.cluster
    save_s, save_source = checkpoint.estimated_save(params, shape.gpus_per_node, shape.nodes)
    return checkpoint.resolve(save_s, save_source, verdict.time.seconds,
                              f"the planner's step for {verdict.layout.short()}", shape.world, mtbf_s)


def _restart_estimates(params: int, result: PlanResult, given: Any, mtbf_s: float | None
                       ) -> list[restart.RestartEstimate]:
    """Restart time and goodput (issue 37) for the layout the interval is for, here and at 16 x and 1,024 x its
    nodes' kind; none when nothing fits or the cluster has no GPUs."""
    verdict = given if given is not None and given.fits else next(iter(result.fitting), None)
    shape = result.cluster
    if verdict is None or verdict.time is None or verdict.memory is None or not shape.gpus_per_node:
        return []
    worst = verdict.memory.worst
    optimizer = worst.components["optimizer"] + worst.host_offload
    return restart.layout_estimates(params, worst.components["weights"], optimizer,
                                    verdict.layout.distributed_optimizer, shape.nodes, shape.gpus_per_node,
                                    verdict.time.seconds, mtbf_s)


def _emit(result: PlanResult, given: Any, top: int, as_json: bool, interval: checkpoint.CheckpointInterval | None,
          cap: BatchCap | None, parameters: dict[str, Any] | None = None,
          restarts: list[restart.RestartEstimate] | None = None) -> None:
    restarts = restarts or []
    if as_json:  # one document: --explain's breakdown goes into it, never before it
        data = report.result_dict(result, top)
        if given:
            data = {"layout": report.verdict_dict(given, result.job), "alternatives": data}
        extra = {"parameters": parameters} if parameters is not None else {}
        emit_json({**data, "checkpoint_interval": interval.to_json() if interval else None,
                   "batch_cap": report.batch_cap_dict(cap), "restart": report.restart_dict(restarts), **extra})
        return
    if given:
        _print_layout_verdict(result.job, given, result.cluster)
        out.print("Feasible alternatives on the same cluster:" if result.fitting else "", markup=False)
    _print_result(result, top)
    out.print(f"Context parallelism for {result.job.model.name} needs "
              f"{engines.context_parallel_requirement(result.job.model)}; the {engines.DEFAULT_ENGINE} engine does not "
              "run it (plan --explain says why)", markup=False)
    if interval is not None:
        out.print(f"Checkpoint interval (Young/Daly, what --checkpoint-interval auto starts from): "
                  f"{interval.describe()}", markup=False)
    for line in report.restart_lines(restarts):
        out.print(line, markup=False)


__all__ = ["Layout", "plan"]
