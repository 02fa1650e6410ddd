"""The planner against published multi-node runs (issue 38 item 5): NVIDIA's DGX Cloud benchmarking recipes
(NeMo on DGX-H100, BF16), each run's model and layout put through the planner twice:

- **TE-class**: the published layout as NeMo runs it (sequence parallelism wherever TP > 1, context parallelism in
  TransformerEngine's attention, the distributed fused Adam) with a kernel profile for a TransformerEngine-class
  stack (TE_CLASS below: an assumption, stated, not fitted to this table);
- **this engine**: what `stepdeploy plan` picks for the megatron engine on the same cluster, sequence and global
  batch (its calibrated H200 efficiencies; megatron-core's sequence parallelism on wherever TP > 1 and the sequence
  divides by TP, plan.search.settle_sequence_parallel; no CP: stepdeploy/data/engines.yaml), and how the engine
  judges the published layout itself. The engine's SP is verified on CPU only, not measured on GPUs: the planner
  counts its activation savings, but no efficiency of the engine under SP is calibrated.

    python bench/published_runs.py [--rows llama3.1-70b@64,...] [--json out.json]

Prints a markdown table (docs/planner.md, "The planner against published runs", holds its output). Pure: no
network; the models not in the catalog are given below as model dicts of the catalog's schema.
tests/unit/plan/test_published_runs.py runs one row.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

from stepdeploy.catalog import GIB, Hardware, ModelSpec, load_hardware, load_model
from stepdeploy.catalog.model import parse_model
from stepdeploy.plan import steptime
from stepdeploy.plan.cluster import ClusterShape, cluster_shape
from stepdeploy.plan.constraints import violations
from stepdeploy.plan.layout import Job, Layout
from stepdeploy.plan.memory import estimate_memory
from stepdeploy.plan.params import ParamCount, count_parameters
from stepdeploy.plan.search import LayoutVerdict, judge, search, settle_param_gather

DGXC = "https://github.com/NVIDIA/dgxc-benchmarking/blob/main/"
SOURCES = {
    "llama3.1-70b": DGXC + "llama3.1/README_70b.md (NeMo 24.09, BF16 table)",
    "llama3.1-405b": DGXC + "llama3.1/README_405b.md (NeMo 24.09, BF16 table)",
    "nemotron4-15b": DGXC + "nemotron/README_15b.md (BF16 table)",
    "nemotron4-340b": DGXC + "nemotron/README_340b.md (NeMo 24.11, BF16 table)",
    "gpt3-175b": DGXC + "nemo_megatron/README_175b.md (BF16 table)",
    "grok1-314b": DGXC + "grok1/README_314b.md (NeMo dev, BF16 table)",
}

# TransformerEngine-class kernels (an assumption, the same for every row): cuDNN fused attention, fused norm +
# linear, fused RoPE and bias-activation kernels leave the GEMMs a larger share of the step (dense 0.75 of the
# measured-or-derated peak against the local spec's 0.635 measured on H200); TP communication overlapped with the
# GEMMs (userbuffers) and DP/PP overlap as NeMo configures it (0.8 hidden against 0.5); a TE layer launches about
# half the kernels of the local spec's (host time per layer halved); experts as TE's grouped GEMM (0.60 against
# the engine's torch._grouped_mm 0.48).
TE_CLASS = {"dense": 0.75, "comm_overlap": 0.8, "experts_grouped_gemm": 0.60, "host_scale": 0.5}

LLAMA_BASE = {"normalization": "RMSNorm", "gated_linear_unit": True, "position_embedding_type": "rope",
              "untie_embeddings_and_output_weights": True, "vocab_size": 128256, "kv_channels": 128}
# Models of the runs that the catalog lacks, in its schema (stepdeploy/data/models/*.yaml). RoPE's base and
# scaling are left at megatron's default: they change neither memory nor FLOPs.
MODELS: dict[str, dict[str, Any]] = {
    "llama3.1-70b": {**LLAMA_BASE, "num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                     "num_query_groups": 8, "ffn_hidden_size": 28672, "max_position_embeddings": 131072,
                     "sources": ["https://huggingface.co/meta-llama/Llama-3.1-70B (config.json)"]},
    "llama3.1-405b": {**LLAMA_BASE, "num_layers": 126, "hidden_size": 16384, "num_attention_heads": 128,
                      "num_query_groups": 8, "ffn_hidden_size": 53248, "max_position_embeddings": 131072,
                      "sources": ["https://huggingface.co/meta-llama/Llama-3.1-405B (config.json)"]},
    # Nemotron-4: squared-ReLU MLP (not gated), LayerNorm, no biases, GQA 8 groups, untied embeddings.
    "nemotron4-15b": {"num_layers": 32, "hidden_size": 6144, "num_attention_heads": 48, "num_query_groups": 8,
                      "kv_channels": 128, "ffn_hidden_size": 24576, "vocab_size": 256000,
                      "max_position_embeddings": 4096, "normalization": "LayerNorm", "gated_linear_unit": False,
                      "sources": ["Nemotron-4 15B Technical Report, arXiv:2402.16819, table 1"]},
    "nemotron4-340b": {"num_layers": 96, "hidden_size": 18432, "num_attention_heads": 96, "num_query_groups": 8,
                       "kv_channels": 192, "ffn_hidden_size": 73728, "vocab_size": 256000,
                       "max_position_embeddings": 4096, "normalization": "LayerNorm", "gated_linear_unit": False,
                       "sources": ["Nemotron-4 340B Technical Report, arXiv:2406.11704, table 1"]},
    # Grok-1: 8 experts top-2 of width 32,768 on every layer, GQA 48/8, tied embeddings: 316B counted (314B).
    "grok1-314b": {"num_layers": 64, "hidden_size": 6144, "num_attention_heads": 48, "num_query_groups": 8,
                   "kv_channels": 128, "ffn_hidden_size": 32768, "vocab_size": 131072,
                   "max_position_embeddings": 8192, "normalization": "RMSNorm", "gated_linear_unit": True,
                   "untie_embeddings_and_output_weights": False,
                   "moe": {"num_experts": 8, "topk": 2, "ffn_hidden_size": 32768},
                   "sources": ["https://github.com/xai-org/grok-1 (model.py: 64 layers, 6144 wide, 48/8 heads, "
                               "8 experts top-2, widening 8)"]},
}


@dataclass(frozen=True)
class Run:
    """One published run: model, GPUs (DGX-H100, 8 a node, InfiniBand), layout, sequence, global batch and the
    published step time (tokens/s/GPU = seq x GBS / step / GPUs, the recipes' own formula)."""

    model: str
    gpus: int
    tp: int
    pp: int
    cp: int
    vpp: int
    ep: int
    mbs: int
    seq: int
    gbs: int
    step_s: float

    @property
    def key(self) -> str:
        return f"{self.model}@{self.gpus}"

    @property
    def published_tokens_per_gpu(self) -> float:
        return self.seq * self.gbs / self.step_s / self.gpus

    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, ep=self.ep, mbs=self.mbs,
                      sequence_parallel=self.tp > 1, optimizer="fused")

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        parts += [f"{name}{value}" for name, value in (("VP", self.vpp), ("CP", self.cp), ("EP", self.ep)) if value > 1]
        return " ".join(parts) + f" MBS{self.mbs}, seq {self.seq}, GBS {self.gbs}"


RUNS = (
    Run("nemotron4-15b", 64, 4, 1, 1, 1, 1, 4, 4096, 256, 2.845),
    Run("nemotron4-15b", 1024, 4, 1, 1, 1, 1, 4, 4096, 4096, 2.895),
    Run("llama3.1-70b", 64, 4, 4, 2, 5, 1, 1, 8192, 128, 14.72),
    Run("llama3.1-70b", 1024, 4, 4, 2, 5, 1, 1, 8192, 2048, 14.92),
    Run("gpt3-175b", 128, 4, 8, 1, 12, 1, 1, 2048, 256, 8.309),
    Run("gpt3-175b", 2048, 4, 8, 1, 12, 1, 1, 2048, 4096, 8.49),
    Run("nemotron4-340b", 128, 8, 8, 1, 12, 1, 1, 4096, 32, 4.61),
    Run("nemotron4-340b", 1024, 8, 8, 1, 12, 1, 1, 4096, 256, 4.73),
    Run("llama3.1-405b", 576, 8, 9, 2, 7, 1, 1, 8192, 252, 17.20),
    Run("grok1-314b", 512, 4, 8, 2, 8, 8, 1, 8192, 1024, 20.83),
    Run("grok1-314b", 2048, 4, 8, 2, 8, 8, 1, 8192, 4096, 21.09),
)


def model_spec(name: str, run: Run) -> ModelSpec:
    if name == "gpt3-175b":
        return load_model("gpt3-175b-seed")
    data = {"name": name, "description": f"{name}, as NVIDIA's DGX Cloud recipe trains it",
            "training": {"seq_length": run.seq, "global_batch_size": run.gbs}, **MODELS[name]}
    return parse_model(data, origin=f"bench/published_runs.py {name}")


def te_class_hardware(hardware: Hardware) -> Hardware:
    eff = hardware.efficiency.model_copy(update={key: value for key, value in TE_CLASS.items() if key != "host_scale"})
    return hardware.model_copy(update={"efficiency": eff})


@contextmanager
def te_class_host() -> Iterator[None]:
    """The TE-class host time: steptime's per-layer constants scaled (bench only; the module is not changed)."""
    scaled = {key: value * TE_CLASS["host_scale"] for key, value in steptime.HOST_S_PER_LAYER.items()}
    with mock.patch.dict(steptime.HOST_S_PER_LAYER, scaled):
        yield


def te_class_verdict(params: ParamCount, job: Job, run: Run, cluster: ClusterShape,
                     hardware: Hardware) -> LayoutVerdict:
    """The published layout as NeMo runs it: plan.search.judge's steps with megatron-core's rules only, no engine
    settling or refusals (TE has SP and CP), under the TE-class host time."""
    layout = settle_param_gather(run.layout())
    broken = tuple(violations(job, layout))
    if broken:
        return LayoutVerdict(layout, broken)
    with te_class_host():
        time = steptime.predict_step_time(params, job, layout, cluster, te_class_hardware(hardware))
    return LayoutVerdict(layout, (), estimate_memory(params, job, layout, cluster), time)


def missing_features(run: Run, best: LayoutVerdict | None) -> str:
    """Why this engine is slower: what the published layout uses that the engine lacks, and what it costs. (Not
    sequence parallelism: the engine runs megatron-core's, and the planner turns it on as NeMo does.)"""
    why = ["local-spec kernels (no TE fusions)"]
    if run.cp > 1:
        why.append("no CP (TE attention)")
    if best is not None and best.layout.recompute == "full":
        why.append("so full recompute")
    if best is not None and best.layout.optimizer_cpu_offload:
        why.append("so optimizer offload")
    if run.ep > 1:
        why.append("torch grouped_mm experts")
    return "; ".join(why)


def evaluate(run: Run, hardware: Hardware) -> dict[str, Any]:
    spec = model_spec(run.model, run)
    cluster = cluster_shape(run.gpus // 8, 8, "H100", "ib-400g")
    params, job = count_parameters(spec), Job(spec, run.seq, run.gbs, cluster.world)
    te = te_class_verdict(params, job, run, cluster, hardware)
    on_engine = judge(params, job, run.layout(), cluster, hardware)
    result = search(spec, cluster, hardware, run.seq, run.gbs)
    best = result.fitting[0] if result.fitting else None
    published = run.published_tokens_per_gpu
    te_tokens = te.time.tokens_per_second / run.gpus if te.time else None
    ours = best.time.tokens_per_second / run.gpus if best and best.time else None
    te_memory = te.memory.worst.total / GIB if te.memory else None
    return {
        "run": run.key, "model": run.model, "parameters": params.total, "gpus": run.gpus, "layout": run.describe(),
        "published_tokens_per_gpu": published, "published_step_s": run.step_s, "source": SOURCES[run.model],
        "te_class_tokens_per_gpu": te_tokens, "te_class_ratio": te_tokens / published if te_tokens else None,
        "te_class_step_s": te.time.seconds if te.time else None,
        "te_class_memory_gib": te_memory, "budget_gib": te.memory.budget / GIB if te.memory else None,
        "capacity_gib": cluster.gpu.usable_bytes / GIB,
        "te_class_fits": te.fits, "te_class_violation": te.reason() if te.violations else None,
        "engine_tokens_per_gpu": ours, "engine_ratio": ours / published if ours else None,
        "engine_layout": _layout_text(best) if best else "nothing fits",
        "engine_on_published_layout": on_engine.reason(),
        "engine_on_published_tokens_per_gpu": (on_engine.time.tokens_per_second / run.gpus
                                               if on_engine.fits and on_engine.time else None),
        "why": missing_features(run, best),
    }


def _layout_text(verdict: LayoutVerdict) -> str:
    lay = verdict.layout
    sp = " sp" if lay.sp else ""
    return f"{lay.short()}{sp} mbs={lay.mbs} {lay.recompute}" + (" offload" if lay.optimizer_cpu_offload else "")


def _memory_verdict(row: dict[str, Any]) -> str:
    if row["te_class_fits"]:
        return "fits"
    if row["te_class_memory_gib"] <= row["capacity_gib"]:
        return f"over the {row['budget_gib']:.1f} GiB budget, within the GPU's {row['capacity_gib']:.1f}"
    return f"over the GPU's {row['capacity_gib']:.1f}"


def _on_published(row: dict[str, Any]) -> str:
    """The engine's own prediction for the published layout, where it runs and fits: the search enumerates VPP up
    to 5, so a published VP7-12 layout can beat the search's first layout."""
    value = row["engine_on_published_tokens_per_gpu"]
    return "" if value is None else f"; published layout: {value:,.0f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| run | layout (published) | published tok/s/GPU | TE-class predicted | ratio | memory (TE-class, "
            "worst stage) | this engine predicted (its layout) | ratio | why slower |")
    lines = [head, "|" + "---|" * 9]
    for row in rows:
        memory = (f"{_num(row['te_class_memory_gib'], '.1f')} GiB: {_memory_verdict(row)}"
                  if row["te_class_memory_gib"] is not None else f"invalid: {row['te_class_violation']}")
        lines.append(
            f"| {row['run']} | {row['layout']} | {row['published_tokens_per_gpu']:,.0f} | "
            f"{_num(row['te_class_tokens_per_gpu'], ',.0f')} | {_num(row['te_class_ratio'], '.2f')} | {memory} | "
            f"{_num(row['engine_tokens_per_gpu'], ',.0f')} ({row['engine_layout']}){_on_published(row)} | "
            f"{_num(row['engine_ratio'], '.2f')} | {row['why']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", help="comma-separated run keys (model@gpus); default: all")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    wanted = set(args.rows.split(",")) if args.rows else None
    runs = [run for run in RUNS if wanted is None or run.key in wanted]
    if wanted and len(runs) != len(wanted):
        known = ", ".join(run.key for run in RUNS)
        print(f"unknown run(s) {sorted(wanted - {r.key for r in runs})}; known: {known}", file=sys.stderr)
        return 2
    hardware = load_hardware()
    rows = [evaluate(run, hardware) for run in runs]
    print(markdown(rows))
    print(f"\nTE-class profile: {TE_CLASS}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["RUNS", "TE_CLASS", "Run", "evaluate", "main", "markdown"]
