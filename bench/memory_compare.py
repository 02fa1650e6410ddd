"""The planner's predicted peak memory against measured peaks, with Megatron's own formulas for comparison.

For each configuration in a JSON-lines file of measurements (default /tmp/gpu-data/memory.jsonl; one object per
line: name, model, gpus, layout as given to `stepdeploy render --layout`, seq, gbs, peak_gib = max over ranks of
torch.cuda.max_memory_allocated, optional memtrace, step_s, mfu, experts), print one markdown table:

- predicted: the planner's `torch_allocated` of the worst stage (stepdeploy.plan, H200 x GPUs on one node);
- Megatron: Megatron-LM's theoretical_memory_usage.py (megatron/training/), re-implemented here from its
  published formula: weights + optimizer = parameters on the most loaded shard x 18 B (6 + 12/DP with the
  distributed optimizer); activations = with SP and selective recompute sbh(18 + 4 ffn/h) per layer, else
  sbh(10 + 24/t) per layer, plus the embedding, final-norm and output-layer terms (x 1.05 in that branch);
- Korthikanti: Table 2 of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models", arXiv 2205.05198), per layer sbh(34 + 5as/h) and its TP / SP / selective / full-recompute variants,
  plus Megatron's weight/optimizer and output-layer terms.

    python bench/memory_compare.py [--measured /tmp/gpu-data/memory.jsonl] [--json out.json] [--phases]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdeploy.catalog import ModelSpec, load_hardware, load_model
from stepdeploy.errors import StepdeployError
from stepdeploy.plan.cluster import cluster_shape
from stepdeploy.plan.layout import Job, Layout, parse_layout
from stepdeploy.plan.memory import MemoryEstimate
from stepdeploy.plan.params import count_parameters
from stepdeploy.plan.search import judge

GIB = 2**30
DEFAULT_MEASURED = Path("/tmp/gpu-data/memory.jsonl")


@dataclass(frozen=True)
class Shape:
    """What Megatron's formulas read: the model, the batch and the parallel layout."""

    spec: ModelSpec
    seq: int
    mbs: int
    tp: int
    pp: int
    vpp: int
    dp: int
    sp: bool
    recompute: str
    distributed_optimizer: bool
    microbatches: int


def megatron_parameters_on_most_loaded_shard(spec: ModelSpec, tp: int, pp: int) -> float:
    """Megatron's parameter count: layers, one embedding table (two when untied and PP 1), divided by TP only
    (the formula does not divide experts by EP)."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    norm = 1 if spec.normalization == "RMSNorm" else 2
    glu = 3 / 2 if spec.gated_linear_unit else 1
    attention = 2 * h * h * (1 + spec.num_query_groups / heads) * (spec.kv_channels * heads / h)
    dense_layer = 2 * h * (spec.ffn_hidden_size * glu + norm) + attention
    if spec.moe is not None:
        moe = spec.moe
        shared = moe.shared_expert_ffn_hidden_size or 0
        moe_layer = 2 * h * (moe.ffn_hidden_size * moe.num_experts * glu + shared * glu + norm) + attention
        dense_count = moe.first_dense_layers
    else:
        moe_layer, dense_count = 0.0, spec.num_layers
    block = dense_layer * dense_count + moe_layer * (spec.num_layers - dense_count) + norm * h
    embedding = h * spec.vocab_size
    shard = (block / pp + embedding) / tp
    if spec.untie_embeddings_and_output_weights and pp == 1:
        shard += embedding / tp
    return shard


def megatron_weight_and_optimizer_bytes(shape: Shape) -> float:
    per_param = 6 + 12 / shape.dp if shape.distributed_optimizer else 18
    return megatron_parameters_on_most_loaded_shard(shape.spec, shape.tp, shape.pp) * per_param


def _pipeline_factor(shape: Shape) -> float:
    if shape.pp > 1 and shape.vpp > 1:
        return 1 + (shape.pp - 1) / (shape.pp * shape.vpp)
    if shape.pp > 1:
        return min(1.0, shape.microbatches / shape.pp)
    return 1.0


def megatron_activation_bytes(shape: Shape) -> float:
    """theoretical_memory_usage's activation estimate (first pipeline stage)."""
    spec, s, b, t, p = shape.spec, shape.seq, shape.mbs, shape.tp, shape.pp
    h, vocab = spec.hidden_size, spec.vocab_size
    embedding = 8 * s * b * p + s * b * h * p  # embedding input (int64) and its dropout, p micro-batches
    if shape.sp and shape.recompute == "selective":
        total = s * b * h * (18 + 4 * spec.ffn_hidden_size / h) * spec.num_layers + embedding
        total *= _pipeline_factor(shape)
        if p == 1:
            total += s * b * h * 4 * (1 + vocab / h)  # output-layer input and cross-entropy
        return total / t
    total = s * b * h * (10 + 24 / t) * spec.num_layers + embedding
    total *= _pipeline_factor(shape)
    if p == 1:
        total += (s * b * vocab / t + s * b * h) * 2  # logits and final-norm output, bf16
    return total * 1.05


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str) -> float:
    """Activation bytes of one transformer layer, Table 2 of Korthikanti et al. 2022 (16-bit, dropout on)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attention_scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * (34 + attention_scores) / t
    return s * b * h * (10 + 24 / t + attention_scores / t)


def korthikanti_total_bytes(shape: Shape) -> float:
    spec = shape.spec
    per_layer = korthikanti_layer_bytes(shape.seq, shape.mbs, spec.hidden_size, spec.num_attention_heads,
                                        shape.tp, shape.sp, shape.recompute)
    activations = per_layer * spec.num_layers * _pipeline_factor(shape)
    if shape.pp == 1:
        activations += shape.seq * shape.mbs * spec.hidden_size * 4 * (1 + spec.vocab_size / spec.hidden_size) \
            / shape.tp
    return megatron_weight_and_optimizer_bytes(shape) + activations


def megatron_total_bytes(shape: Shape) -> float:
    return megatron_weight_and_optimizer_bytes(shape) + megatron_activation_bytes(shape)


def _model(name: str) -> ModelSpec:
    try:
        return load_model(name)
    except StepdeployError:
        return load_model(f"proxy-0.7b-{name}")


def layout_of(record: dict[str, Any]) -> Layout:
    layout = parse_layout(record.get("layout") or "")
    experts = record.get("experts")
    if experts is not None:  # what the engine ran: grouped_mm (ETP 1) or SequentialMLP
        layout = parse_layout(f"grouped_gemm={'on' if experts == 'grouped_mm' else 'off'}", layout)
    return layout


def planner_estimate(record: dict[str, Any]) -> tuple[MemoryEstimate, Any, Job, Layout]:
    spec = _model(record["model"])
    gpus = int(record["gpus"])
    layout = layout_of(record)
    job = Job(spec, int(record.get("seq") or spec.training.seq_length),
              int(record.get("gbs") or spec.training.global_batch_size), gpus)
    verdict = judge(count_parameters(spec), job, layout, cluster_shape(1, gpus, "H200", "ethernet-tcp"),
                    load_hardware())
    if verdict.violations or verdict.memory is None:
        raise SystemExit(f"{record.get('name')}: the planner rejects {layout.short()}: {verdict.reason()}")
    return verdict.memory, verdict.time, job, layout


def shape_of(job: Job, layout: Layout) -> Shape:
    return Shape(job.model, job.seq_length, layout.mbs, layout.tp, layout.pp, layout.vpp, job.dp(layout),
                 layout.sp, layout.recompute, layout.distributed_optimizer, job.microbatches(layout))


def compare(record: dict[str, Any]) -> dict[str, Any]:
    memory, time, job, layout = planner_estimate(record)
    worst = max(memory.stages, key=lambda stage: stage.torch_allocated)
    shape = shape_of(job, layout)
    measured = float(record["peak_gib"])
    predicted = worst.torch_allocated / GIB
    megatron = megatron_total_bytes(shape) / GIB
    korthikanti = korthikanti_total_bytes(shape) / GIB
    return {
        "name": record.get("name") or f"{record['model']} {record['gpus']} GPU {record.get('layout')}",
        "model": job.model.name, "gpus": job.world, "layout": record.get("layout"),
        "experts": "grouped_mm" if layout.grouped_experts else "sequential",
        "measured_gib": measured,
        "predicted_gib": round(predicted, 3), "error": round(predicted / measured - 1, 4),
        "peak_phase": "optimizer step" if worst.optimizer_step_peak > worst.forward_backward_peak
        else "forward-backward",
        "components_gib": {name: round(value / GIB, 3) for name, value in worst.components.items()},
        "megatron_gib": round(megatron, 3), "megatron_error": round(megatron / measured - 1, 4),
        "korthikanti_gib": round(korthikanti, 3), "korthikanti_error": round(korthikanti / measured - 1, 4),
        "measured_step_s": record.get("step_s"),
        "predicted_step_s": round(time.seconds, 4) if time else None,
        "memtrace": record.get("memtrace"),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| configuration | measured GiB | predicted GiB | error | peak in | Megatron formula GiB | error "
             "| Korthikanti Table 2 GiB | error | step s measured / predicted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        step = "-"
        if row["measured_step_s"] and row["predicted_step_s"]:
            step = f"{row['measured_step_s']:.3f} / {row['predicted_step_s']:.3f}"
        lines.append(
            f"| {row['name']} | {row['measured_gib']:.2f} | {row['predicted_gib']:.2f} | {row['error']:+.1%} "
            f"| {row['peak_phase']} | {row['megatron_gib']:.2f} | {row['megatron_error']:+.1%} "
            f"| {row['korthikanti_gib']:.2f} | {row['korthikanti_error']:+.1%} | {step} |")
    within = sum(abs(row["error"]) <= 0.05 for row in rows)
    lines.append("")
    lines.append(f"planner within 5 %: {within} of {len(rows)}; Megatron formula within 5 %: "
                 f"{sum(abs(row['megatron_error']) <= 0.05 for row in rows)} of {len(rows)}")
    return "\n".join(lines)


# memtrace phase -> (measured field, the planner's figure from its components in GiB)
PHASES: dict[str, tuple[str, Any]] = {
    # DDP wraps the model at build: bf16 params + the fp32 grad buffer
    "model": ("allocated_gib", lambda c: c["weights"] + c["gradients"]),
    # the optimizer builds its fp32 master copy (4 of the 12 B); Adam's m, v come at the first step
    "optimizer": ("allocated_gib", lambda c: c["weights"] + c["gradients"] + c["optimizer"] / 3),
    "forward_backward_1": ("peak_gib", lambda c: c["weights"] + c["gradients"] + c["optimizer"] / 3
                           + c["activations"] + c["logits"] + c["dispatcher"]),
    "optimizer_step_1": ("allocated_gib", lambda c: c["weights"] + c["gradients"] + c["optimizer"]),
    "end": ("peak_gib", None),  # the planner's torch_allocated
}


def phase_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured memtrace phase next to what the planner's components say it should be."""
    out = []
    for row in rows:
        trace, parts = row.get("memtrace") or {}, row["components_gib"]
        for phase, (field, planner) in PHASES.items():
            if phase not in trace or field not in trace[phase]:
                continue
            measured = float(trace[phase][field])
            predicted = row["predicted_gib"] if planner is None else planner(parts)
            out.append({"name": row["name"], "phase": f"{phase} ({field.removesuffix('_gib')})",
                        "measured_gib": measured, "predicted_gib": round(predicted, 3),
                        "error": round(predicted / measured - 1, 4)})
    return out


def phases(rows: list[dict[str, Any]]) -> str:
    lines = ["| configuration | memtrace phase | measured GiB | planner GiB | error |", "|---|---|---|---|---|"]
    for item in phase_rows(rows):
        lines.append(f"| {item['name']} | {item['phase']} | {item['measured_gib']:.3f} | {item['predicted_gib']:.3f} "
                     f"| {item['error']:+.1%} |")
    return "\n".join(lines)


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", type=Path, default=DEFAULT_MEASURED, help="JSON lines of measured peaks")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--phases", action="store_true", help="also a table of memtrace phases vs the planner")
    args = parser.parse_args(argv)
    if not args.measured.is_file():
        print(f"no measurements at {args.measured}", file=sys.stderr)
        return 2
    rows = [compare(record) for record in read_records(args.measured)]
    print(markdown(rows))
    if args.phases:
        print()
        print(phases(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
