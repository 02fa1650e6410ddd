"""What a training engine can run (stepdeploy/data/engines.yaml), as one question the planner and render both ask:
does this engine refuse this layout of this model, and why. Pure."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from importlib import resources
from typing import Any

import yaml

from stepdeploy.catalog import ModelSpec
from stepdeploy.plan.layout import Layout, stage_layer_counts

DEFAULT_ENGINE = "megatron"


@cache
def capabilities() -> dict[str, Any]:
    return yaml.safe_load(resources.files("stepdeploy.data").joinpath("engines.yaml").read_text())


def _words(text: str) -> str:
    return " ".join(text.split())


def context_parallel_requirement(spec: ModelSpec) -> str:
    """What context parallelism needs for this model, in one sentence (the plan states it per model)."""
    cp = capabilities()["megatron"]["context_parallel"]
    need = "TransformerEngine's attention"
    if spec.sliding_window is not None:
        return f"{need} with cp_comm_type a2a or all_gather for its sliding windows ({cp['sliding_window']})"
    return f"{need} (any cp_comm_type: p2p, a2a, all_gather)"


def needs(spec: ModelSpec, layout: Layout) -> list[str]:
    """Software a layout needs beyond the engine's stock packages, each as 'package: why' (the plan's JSON lists
    them per layout; `stepdeploy preflight --model M --layout L` fails a node whose probe did not find the package,
    or found it not importable: preflight/host.py check_transformer_engine)."""
    return [f"transformer_engine: {context_parallel_requirement(spec)}"] if layout.cp > 1 else []


def settle(engine: str, layout: Layout) -> Layout:
    """Sequence parallelism left open (None) is off where the engine does not run it."""
    if layout.sequence_parallel is None and not capabilities()[engine]["sequence_parallel"]["runs"]:
        return replace(layout, sequence_parallel=False)
    return layout


def refusal(engine: str, layout: Layout, spec: ModelSpec) -> str | None:
    """Why `engine` cannot run `layout` of `spec` (one sentence), or None when it can."""
    caps = capabilities()[engine]
    uneven = layout.pp > 1 and len(set(stage_layer_counts(spec.num_layers, layout) or ())) > 1
    checks = (("virtual_pipeline", layout.vpp > 1, f"VPP={layout.vpp}"),
              ("uneven_pipeline_split", uneven, f"an uneven split of {spec.num_layers} layers over PP={layout.pp}"),
              ("optimizer_cpu_offload", layout.optimizer_cpu_offload, "optimizer CPU offload"),
              ("context_parallel", layout.cp > 1, f"CP={layout.cp}"),
              ("sequence_parallel", layout.sp, "sequence parallelism"))
    for key, used, what in checks:
        if used and not caps[key]["runs"]:
            extra = f"; {spec.name} needs {context_parallel_requirement(spec)}" if key == "context_parallel" else ""
            return f"the {engine} engine does not run {what}: {_words(caps[key]['why'])}{extra}"
    if layout.optimizer not in caps["adam_implementations"]:
        return f"the {engine} engine's AdamW runs {', '.join(caps['adam_implementations'])}, not {layout.optimizer}"
    if engine == "megatron" and spec.swiglu_limits and not layout.grouped_experts:
        return (f"{spec.name}: its clamped experts need the megatron engine's grouped experts (torch._grouped_mm), "
                "which this layout does not use (ETP>1 or grouped_gemm off)")
    return None


def explain(engine: str, spec: ModelSpec) -> list[str]:
    """One line per capability: what the engine runs and how, or what it does not and why."""
    lines = []
    for key, value in capabilities()[engine].items():
        if not isinstance(value, dict):
            lines.append(f"{key.replace('_', ' ')}: {', '.join(value)}")
            continue
        verdict = "runs" if value["runs"] else "not offered"
        lines.append(f"{key.replace('_', ' ')}: {verdict}: {_words(value.get('how') or value.get('why', ''))}")
    lines.append(f"context parallelism for {spec.name} would need {context_parallel_requirement(spec)}")
    return lines
