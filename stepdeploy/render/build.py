"""Choosing a layout and writing a rendered run directory: the steps between the planner and the files.

`choose_layout` and `build` read the inventory and the catalog and return values; `write_run` is the one
function here that writes (all or nothing). The CLI (`stepdeploy render`) and the rollout both use them.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from stepdeploy import __version__, compat, corpus, safeio
from stepdeploy.catalog import ModelSpec, load_hardware, load_model
from stepdeploy.corpus import ShippedDataset
from stepdeploy.errors import BadInput, StepdeployError
from stepdeploy.inventory import load_cluster
from stepdeploy.inventory.model import Cluster
from stepdeploy.plan.cluster import shape_from_cluster
from stepdeploy.plan.layout import Job, Layout, check_sequence, parse_layout
from stepdeploy.plan.params import count_parameters
from stepdeploy.plan.report import optimizer_assumed, shortfall
from stepdeploy.plan.search import judge, search
from stepdeploy.render.facts import facts_for
from stepdeploy.render.options import RenderOptions
from stepdeploy.render.run import RenderedRun, load_workload_sources, render_run
from stepdeploy.render.workload import choose_engine, megatron_runs

# What build_run does with a layout the planner says does not fit: render it and say so in the manifest (the
# rollout, whose memory gate judges the run), refuse it (`render`, exit 1), or render it marked forced (--force).
Misfit = Literal["allow", "refuse", "force"]


def plan_hint(cluster: Cluster, spec: ModelSpec, seq: int, gbs: int, layout: Layout | None = None) -> str:
    """The `stepdeploy plan` command for this very job: the inventory's path, and the sequence, batch and layout
    where they are not the model's defaults."""
    words = ["stepdeploy", "plan", "-m", spec.name, "-i", str(cluster.source)]
    if seq != spec.training.seq_length:
        words += ["--seq", str(seq)]
    if gbs != spec.training.global_batch_size:
        words += ["--gbs", str(gbs)]
    if layout is not None:
        words += ["--layout", layout.short()]
    return shlex.join(words)


def choose_layout(cluster: Cluster, spec: ModelSpec, layout_text: str | None, seq: int,
                  gbs: int) -> tuple[Layout, dict[str, Any]]:
    """The layout to render and what the planner said about it. CPU nodes: pure data parallel."""
    gpus = cluster.nodes[0].gpus_per_node or 0
    given = parse_layout(layout_text) if layout_text else None
    if not gpus:
        return given or Layout(), {"planner": "CPU nodes: data parallel only, no GPU memory to plan"}
    shape, hardware = shape_from_cluster(cluster), load_hardware()
    params = count_parameters(spec)
    job = Job(spec, seq, gbs, shape.world)
    if given is not None:
        verdict = judge(params, job, given, shape, hardware)
        if verdict.violations:
            reasons = "; ".join(f"[{v.rule}] {v.reason}" for v in verdict.violations)
            raise BadInput(f"layout {given.short()} cannot run: {reasons}",
                           hint=plan_hint(cluster, spec, seq, gbs))
    else:
        result = search(spec, shape, hardware, seq, gbs)
        # The planner offers only what the megatron engine runs (plan/engines.py); the filter stays as a guard.
        # search() judged each layout as the engine runs it and sorted the fitting ones fastest first.
        runnable = [v for v in result.fitting if megatron_runs(v.layout, spec)]
        if not runnable:
            raise StepdeployError(f"no layout of {spec.name} that the megatron engine runs fits on "
                                  f"{shape.describe()}", hint=plan_hint(cluster, spec, seq, gbs))
        verdict = runnable[0]
    summary: dict[str, Any] = {"planner": "chosen" if given is None else "given", "fits": verdict.fits}
    if verdict.memory and not verdict.fits:
        summary["shortfall"] = shortfall(verdict.memory)
    if verdict.memory and verdict.time:
        summary |= {"worst_stage_gib": round(verdict.memory.worst.total / 2**30, 2),
                    # what torch.cuda.max_memory_allocated should read: the rollout's memory gate compares
                    "predicted_torch_allocated_gib": round(max(s.torch_allocated for s in verdict.memory.stages)
                                                           / 2**30, 2),
                    "predicted_step_s": round(verdict.time.seconds, 4),
                    "predicted_mfu": round(verdict.time.mfu, 4),
                    "optimizer": optimizer_assumed(verdict.layout)["summary"]}
    return verdict.layout, summary


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_out_dir(out_dir: Path) -> None:
    """`out_dir` can become a new run directory: it does not exist (or is an empty directory) and its parent
    is, or can be made, a writable directory. BadInput before anything is rendered or written."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise BadInput(f"{out_dir} exists and is not a directory; give a new --out")
    try:
        occupied = out_dir.is_dir() and any(out_dir.iterdir())
    except OSError as exc:
        raise BadInput(f"{out_dir}: cannot read it ({exc.strerror or exc}); give a new --out") from None
    if occupied:
        raise BadInput(f"{out_dir} exists and is not empty; give a new --out (a run directory is never "
                       "rewritten in place)")
    safeio.check_output_dir(out_dir.parent, "run directory")


def write_run(rendered: RenderedRun, out_dir: Path) -> None:
    """Write every file, all or nothing: into a temporary sibling, then renamed to `out_dir`."""
    check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for item in rendered.files:
            path = tmp / item.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(item.content)
            path.chmod(0o755 if item.executable else 0o644)
        os.replace(tmp, out_dir)  # rename(2): atomic, onto an empty directory too (check_out_dir allowed no other)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build(inventory: str, model: str, layout: str | None, opts: RenderOptions,
          facts_dir: Path | None = None, force: bool = False) -> RenderedRun:
    """`stepdeploy render`: the run of `model` on every node of `inventory` (see build_run; writes nothing). A
    layout that does not fit is refused unless `force`."""
    rendered, _summary = build_run(load_cluster(inventory), load_model(model), layout, opts, facts_dir=facts_dir,
                                   on_misfit="force" if force else "refuse")
    return rendered


def build_run(cluster: Cluster, spec: ModelSpec, layout: str | None, opts: RenderOptions, *,
              facts_dir: Path | None = None, inputs: dict[str, Any] | None = None, on_misfit: Misfit = "allow",
              ) -> tuple[RenderedRun, dict[str, Any]]:
    """The one render path (the CLI's `render` and every rollout attempt): the layout chosen or judged, the
    peak TFLOPS of the nodes' GPU, the NCCL facts provisioning saved (`facts_dir`, else the inventory's default
    facts directory when it exists) and the prepared dataset, rendered into the text of every file. `inputs`:
    more for the manifest's inputs (the rollout's rung); `on_misfit`: what a layout that does not fit gets (Misfit).
    Returns the run and the planner's summary of its layout; writes nothing."""
    seq = opts.seq_length or spec.training.seq_length
    check_sequence(spec, seq)  # before the search: too long a sequence is bad input, not 'no layout fits'
    engine = choose_engine(opts, cluster.nodes[0].gpus_per_node or 0)
    # the stack before the search, as `plan` judges it: a profile that cannot run here is bad input (exit 2)
    compat.require_stack(cluster, spec, parse_layout(layout) if layout else None, engine=engine)
    facts = facts_for(cluster.source, [node.name for node in cluster.nodes], facts_dir)
    gbs = opts.global_batch_size or spec.training.global_batch_size
    chosen, summary = choose_layout(cluster, spec, layout, seq, gbs)
    if summary.get("fits") is False and on_misfit != "allow":
        if on_misfit == "refuse":
            raise StepdeployError(f"layout {chosen.short()} does not fit on {shape_from_cluster(cluster).describe()}: "
                                  f"{summary['shortfall']}",
                                  hint=f"{plan_hint(cluster, spec, seq, gbs, chosen)}; or render it anyway with "
                                       "--force (the manifest records it)")
        summary["forced"] = True
    peak = None
    if cluster.nodes[0].gpus_per_node and cluster.nodes[0].gpu_model:
        peak = load_hardware().peak_tflops(shape_from_cluster(cluster).gpu)
    source = Path(cluster.source)
    inventory = {"path": str(source.resolve())} | ({"sha256": sha256_file(source)} if source.is_file() else {})
    manifest_inputs = {"inventory": inventory,
                       "model": {"name": spec.name,
                                 "sha256": hashlib.sha256(spec.model_dump_json().encode()).hexdigest()},
                       "layout": {"given": layout, **summary}, **(inputs or {})}
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rendered = render_run(cluster, spec, chosen, opts, inputs=manifest_inputs, created=created, version=__version__,
                          workload_sources=load_workload_sources(), facts=facts, peak_tflops=peak,
                          dataset=shipped_dataset(opts))
    return rendered, {**summary, "layout": chosen.short()}


def shipped_dataset(opts: RenderOptions) -> ShippedDataset | None:
    """The prepared dataset `--data` names, checked and read (None: synthetic tokens)."""
    return ShippedDataset.read(corpus.load_prepared(Path(opts.data))) if opts.data else None
