"""What the planner calls feasible, the megatron engine runs: for every catalog model on every example and bench
inventory (and a 16 x 8 H200 cluster), the top layouts `stepdeploy plan` lists as fitting must render without
refusal (render's check_engine) and pass the engine's own configuration checks: megatron-core's TransformerConfig,
OptimizerConfig and DistributedDataParallelConfig built on the CPU from the workload.json render writes.

    python bench/plan_engine_matrix.py [--top 3] [--models a,b] [--json out.json]

Prints one markdown row per (model, cluster): fitting layouts, how many were checked, how many the engine
refused (with the first reason). Needs torch and megatron-core (0.16.1 here). tests/unit/plan/test_plan_engine.py
runs a subset in the suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

with contextlib.suppress(ImportError):  # before ansible-core patches sys.intern (tests/unit/conftest.py says why)
    import torch._dynamo  # noqa: F401

from stepdeploy.catalog import ModelSpec, load_hardware, load_model
from stepdeploy.catalog.loader import model_names
from stepdeploy.errors import StepdeployError
from stepdeploy.inventory import load_cluster
from stepdeploy.plan.cluster import ClusterShape, cluster_shape, shape_from_cluster
from stepdeploy.plan.layout import stage_layer_counts
from stepdeploy.plan.search import search
from stepdeploy.render.options import RenderOptions
from stepdeploy.render.workload import check_engine, workload_config

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = str(ROOT / "stepdeploy" / "workload")
INVENTORIES = ("inventory/dgx.ini", "inventory/examples/hgx-h100-pair.ini", "inventory/examples/dgx-spark-pair.yml",
               "bench/inventories/h200x1.ini", "bench/inventories/h200x2.ini", "bench/inventories/h200x8.ini")


@dataclass
class Row:
    model: str
    cluster: str
    fitting: int
    checked: int
    refused: list[str]
    layouts: list[str]


def clusters() -> list[tuple[str, ClusterShape]]:
    shapes = [(path, shape_from_cluster(load_cluster(str(ROOT / path)))) for path in INVENTORIES]
    return [*shapes, ("16 x 8 H200 (ib-400g)", cluster_shape(16, 8, "H200", "ib-400g"))]


def engine_refusal(spec: ModelSpec, layout: Any, shape: ClusterShape) -> str | None:
    """Why render or megatron-core's config objects refuse this layout (None: both accept it)."""
    if WORKLOAD not in sys.path:
        sys.path.insert(0, WORKLOAD)  # the engine's modules import their siblings by plain name
    import engine_megatron
    import model_chunks
    import rope
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        check_engine("megatron", layout, spec, shape.gpus_per_node)
        cfg = workload_config(spec, layout, RenderOptions(run_id="matrix"), engine="megatron", world=shape.world,
                              peak_tflops=None)
    except StepdeployError as exc:
        return f"render: {exc}"
    try:
        kwargs = engine_megatron.transformer_config_kwargs(cfg)
        rope.prepare(kwargs)  # as the engine's build() does: megatron's fused RoPE path gets its kernel
        TransformerConfig(**kwargs)
        model_chunks._te_version_without_te()
        OptimizerConfig(**model_chunks.optimizer_config_kwargs(cfg))
        DistributedDataParallelConfig(**engine_megatron.ddp_config_kwargs(cfg))
    except (AssertionError, ValueError, TypeError, RuntimeError) as exc:
        return f"megatron-core: {type(exc).__name__}: {exc}"
    return None


def check(model: str, name: str, shape: ClusterShape, top: int) -> Row:
    spec = load_model(model)
    result = search(spec, shape, load_hardware(), spec.training.seq_length, spec.training.global_batch_size)
    listed = result.fitting[:top]
    refused = [f"{v.layout.short()}: {why}" for v in listed if (why := engine_refusal(spec, v.layout, shape))]
    return Row(model, name, len(result.fitting), len(listed), refused, [describe(v.layout, spec) for v in listed])


def describe(layout: Any, spec: ModelSpec) -> str:
    knobs = ["offload"] if layout.optimizer_cpu_offload else []
    counts = stage_layer_counts(spec.num_layers, layout) or ()
    knobs += ["uneven=" + "/".join(map(str, counts))] if len(set(counts)) > 1 else []
    return ",".join([layout.short(), f"mbs={layout.mbs}", layout.recompute, *knobs, layout.optimizer])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--models", help="comma-separated catalog models (default: all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    models = args.models.split(",") if args.models else model_names()
    rows = [check(model, name, shape, args.top) for model in models for name, shape in clusters()]
    print("| model | cluster | fitting | checked | refused |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.model} | {row.cluster} | {row.fitting} | {row.checked} | "
              f"{len(row.refused)}{': ' + row.refused[0] if row.refused else ''} |")
    checked, refused = sum(r.checked for r in rows), sum(len(r.refused) for r in rows)
    listed = [layout for row in rows for layout in row.layouts]
    kinds = {"VPP > 1": "vpp=", "uneven splits": "uneven=", "offload": "offload", "fused AdamW": "fused"}
    print(f"\n{checked} layouts checked, {refused} refused; among them "
          + ", ".join(f"{sum(key in text for text in listed)} {name}" for name, key in kinds.items()))
    if args.json:
        args.json.write_text(json.dumps([row.__dict__ for row in rows], indent=2))
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
