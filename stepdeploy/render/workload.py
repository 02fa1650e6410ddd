"""The workload's configuration (workload.json) from the model, the chosen layout and the options. Pure.

The workload reads only this file: model shape (megatron-core field names), parallel layout, training
schedule, process-group timeout, and the planner's FLOPs per token so it reports MFU by the same count.
"""

from __future__ import annotations

from typing import Any

from stepdeploy.catalog import LayerShape, ModelSpec
from stepdeploy.errors import BadInput
from stepdeploy.plan import engines
from stepdeploy.plan.flops import model_flops_per_token
from stepdeploy.plan.layout import Layout, stage_layer_counts, vpp_group_size
from stepdeploy.plan.params import count_parameters
from stepdeploy.render.options import DEFAULT_LR, RenderOptions

MODEL_FIELDS_DROPPED = ("description", "sources", "training")


def choose_engine(opts: RenderOptions, gpus_per_node: int) -> str:
    return opts.engine or ("megatron" if gpus_per_node else "torch")


def megatron_runs(layout: Layout, spec: ModelSpec) -> bool:
    """Whether the megatron engine runs this layout of this model (what check_engine would not refuse): the
    engine's capabilities (stepdeploy/data/engines.yaml), which the planner consults too."""
    return engines.refusal("megatron", engines.settle("megatron", layout), spec) is None


def check_engine(engine: str, layout: Layout, spec: ModelSpec, gpus_per_node: int) -> None:
    """Refuse what an engine cannot run, saying what would."""
    if engine == "torch":
        split = {k: getattr(layout, k) for k in ("tp", "pp", "cp", "ep", "etp") if getattr(layout, k) > 1}
        if split:
            given = ",".join(f"{k}={v}" for k, v in split.items())
            raise BadInput(f"the torch engine trains data-parallel only (DDP); layout {given} needs the megatron "
                           "engine on GPU nodes", hint="drop --layout (pure DP) or pass --engine megatron")
    elif gpus_per_node == 0:
        raise BadInput("the megatron engine needs GPUs; the inventory's nodes have none",
                       hint="use --engine torch on CPU nodes")
    else:
        refused = engines.refusal(engine, engines.settle(engine, layout), spec)
        if refused:
            raise BadInput(refused, hint=f"stepdeploy plan -m {spec.name} lists the layouts this engine runs")
    if engine == "torch" and not spec.uniform_attention:
        raise BadInput(f"{spec.name}: the torch engine trains uniform layers only (no sliding windows, per-head "
                       "gates, per-layer RoPE, zero-centred norms or SwiGLU clamps)",
                       hint="pass --engine megatron on GPU nodes, or use a proxy model (e.g. tiny-moe)")


def workload_config(spec: ModelSpec, layout: Layout, opts: RenderOptions, *, engine: str, world: int,
                    peak_tflops: float | None) -> dict[str, Any]:
    seq = opts.seq_length or spec.training.seq_length
    if seq > spec.max_position_embeddings:
        raise BadInput(f"sequence length {seq} exceeds {spec.name}'s max_position_embeddings "
                       f"{spec.max_position_embeddings}")
    gbs = opts.global_batch_size or spec.training.global_batch_size
    dp = world // (layout.tp * layout.pp * layout.cp)
    if dp < 1 or world % (layout.tp * layout.pp * layout.cp):
        raise BadInput(f"layout {layout.short()} does not divide {world} ranks")
    if gbs % (layout.mbs * dp):
        raise BadInput(f"global batch {gbs} is not a multiple of micro-batch {layout.mbs} x DP {dp}")
    group = vpp_group_size(gbs // (layout.mbs * dp), layout.pp) if layout.vpp > 1 else None
    if layout.vpp > 1 and group is None:
        raise BadInput(f"VPP={layout.vpp} needs at least PP={layout.pp} micro-batches per step, got "
                       f"{gbs // (layout.mbs * dp)}", hint="raise the global batch or lower the micro-batch size")
    flops = model_flops_per_token(count_parameters(spec), spec, seq).total
    model = {k: v for k, v in spec.model_dump().items() if k not in MODEL_FIELDS_DROPPED}
    model["layers"] = [layer_config(shape) for shape in spec.layers()]
    model["mtp_layers"] = [layer_config(shape) for shape in spec.mtp_layers()]
    model["uniform_attention"] = spec.uniform_attention
    return {
        "format": 1,
        "engine": engine,
        "run_id": opts.run_id,
        "stage": opts.stage,
        "model": model,
        "parallel": _parallel(layout, spec.num_layers) | {"vpp_microbatch_group": group},
        "training": {
            "seq_length": seq,
            "micro_batch_size": layout.mbs,
            "global_batch_size": gbs,
            "iterations": opts.effective_iterations,
            "lr": opts.lr or spec.training.lr or DEFAULT_LR,
            "warmup_iterations": opts.warmup_iterations or max(1, opts.effective_iterations // 10),
            "decay_iterations": opts.decay_iterations or opts.effective_iterations,
            "seed": opts.seed,
            "save_interval": opts.save_interval,
            "keep_checkpoints": opts.keep_checkpoints,
        },
        "world_size": world,
        "pg_timeout_s": opts.effective_pg_timeout_s,
        "flops_per_token": flops,
        "peak_tflops": peak_tflops,
    }


def layer_config(shape: LayerShape) -> dict[str, Any]:
    """One layer as the engine builds it (workload/layers.py): the catalog's shape of that layer."""
    return {"index": shape.index, "attention": shape.attention, "ffn": shape.ffn, "num_heads": shape.num_heads,
            "window": shape.window, "rope": shape.rope.model_dump(), "swiglu_limit": shape.swiglu_limit,
            "shared_swiglu_limit": shape.shared_swiglu_limit}


def _parallel(layout: Layout, num_layers: int) -> dict[str, Any]:
    """The layout as megatron-core takes it. The pipeline split is the planner's (stage_layer_counts): an uneven one
    is written as megatron's first/last stage sizes, which megatron-core would otherwise refuse ("num_layers
    should be divisible by pipeline_model_parallel_size")."""
    first, last = layout.first_stage_layers, layout.last_stage_layers
    counts = stage_layer_counts(num_layers, layout) if layout.pp > 1 else None
    if counts and len(set(counts)) > 1:
        first, last = counts[0], counts[-1]
    return {
        "tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "cp": layout.cp, "ep": layout.ep, "etp": layout.etp,
        "sequence_parallel": layout.sp,
        "recompute": layout.recompute,
        "distributed_optimizer": layout.distributed_optimizer,
        "overlap_grad_reduce": layout.overlap_grad_reduce,
        "overlap_param_gather": layout.param_gather_overlap,
        "dispatcher": layout.dispatcher,
        "grouped_gemm": layout.grouped_gemm,
        # megatron engine's MoE experts: torch._grouped_mm (experts_grouped.py, ETP 1 only) or SequentialMLP
        "experts": "grouped_mm" if layout.grouped_experts else "sequential",
        "cross_entropy_fusion": layout.cross_entropy_fusion,
        "rope_fusion": layout.rope_fusion,
        **({} if layout.router_bias_update else {"router_bias_update": False}),  # the engines' default: on
        # megatron-core's combined 1F1B overlap of the expert-parallel all-to-all (only when the layout asks)
        **({"overlap_moe_expert_parallel_comm": True} if layout.overlap_moe_expert_parallel_comm else {}),
        "first_stage_layers": first,
        "last_stage_layers": last,
        "overlap_p2p_comm": layout.overlap_p2p_comm,
        # torch AdamW's implementation, and the whole optimizer on the host (megatron's HybridDeviceOptimizer)
        "optimizer": layout.optimizer,
        "optimizer_cpu_offload": layout.optimizer_cpu_offload,
    }
