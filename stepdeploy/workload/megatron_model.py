"""The megatron engine's model (engine_megatron.py trains it): megatron-core's TransformerConfig and DDP config from
workload.json, and GPTModel built from the catalog model -- megatron-core's local (no-TransformerEngine) layer specs
with torch SDPA as the core attention (attention.py), MoE experts on torch._grouped_mm (experts_grouped.py), the
per-layer specs of models whose layers differ (layers.py), and norms that run under sequence parallelism
(layers.LocalNorm: megatron's own WrappedTorchNorm refuses it). Standard library + torch + megatron-core only
(shipped as a file).

Sequence parallelism is megatron-core's own (TransformerConfig.sequence_parallel, on wherever TP > 1 unless the
layout turns it off): the embedding's output is scattered along the sequence, each TP rank keeps its slice of the
h-wide activations (norms, residuals, dropout-free adds), the column- and row-parallel linears all-gather and
reduce-scatter the sequence instead of all-reducing, and finalize_model_grads all-reduces the norms' (and the
routers') gradients over TP.
"""

from __future__ import annotations

from typing import Any

import attention
import experts_grouped
import layers
import model_chunks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from metrics import log


def transformer_config_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """megatron-core TransformerConfig arguments from workload.json (pure: testable without megatron)."""
    m, p = cfg["model"], cfg["parallel"]
    kwargs: dict[str, Any] = {
        "num_layers": m["num_layers"], "hidden_size": m["hidden_size"],
        "num_attention_heads": m["num_attention_heads"], "num_query_groups": m["num_query_groups"],
        "kv_channels": m["kv_channels"], "ffn_hidden_size": m["ffn_hidden_size"],
        "normalization": m["normalization"], "gated_linear_unit": m["gated_linear_unit"],
        "activation_func": F.silu if m["gated_linear_unit"] else F.gelu,
        "add_bias_linear": m["add_bias_linear"], "add_qkv_bias": m["add_qkv_bias"],
        "qk_layernorm": m["qk_layernorm"],
        "tensor_model_parallel_size": p["tp"], "pipeline_model_parallel_size": p["pp"],
        "context_parallel_size": p["cp"], "expert_model_parallel_size": p["ep"],
        "expert_tensor_parallel_size": p["etp"], "sequence_parallel": p["sequence_parallel"] and p["tp"] > 1,
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "bf16": True, "params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16,
        # Fusions that need apex or TransformerEngine are off; torch SDPA replaces the unfused attention.
        "gradient_accumulation_fusion": False, "bias_activation_fusion": False, "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        # RoPE through megatron-core's fused path; without TE its kernel is rope.py's (the engine installs it before
        # building the config): measured on one H100, the dense proxy's step 0.647 -> 0.579 s (docs/benchmarks.md)
        "apply_rope_fusion": p.get("rope_fusion", True) and m["position_embedding_type"] == "rope",
        # megatron-core's own fused vocab-parallel cross-entropy (no TE needed): measured on one H200, dense
        # proxy MBS 4: 59.4 % MFU against 58.3 % unfused, +1 GiB peak (docs/benchmarks.md, 2026-11-29)
        "cross_entropy_loss_fusion": p.get("cross_entropy_fusion", True), "cross_entropy_fusion_impl": "native",
    }
    kwargs |= model_chunks.pipeline_kwargs(p)  # virtual pipeline, p2p overlap, first/last stage sizes
    if p["recompute"] == "full":
        kwargs |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    elif p["recompute"] == "selective":
        kwargs["recompute_granularity"] = "selective"
    if m.get("mtp_num_layers"):
        kwargs["mtp_num_layers"] = m["mtp_num_layers"]  # megatron's MTP loss scale (0.1 over the layers) applies
    moe = m["moe"]
    if moe:
        dense = moe["first_dense_layers"]
        kwargs |= {
            "num_moe_experts": moe["num_experts"], "moe_router_topk": moe["topk"],
            "moe_ffn_hidden_size": moe["ffn_hidden_size"],
            "moe_shared_expert_intermediate_size": moe["shared_expert_ffn_hidden_size"] or None,
            "moe_layer_freq": [0] * dense + [1] * (m["num_layers"] - dense),
            "moe_router_score_function": moe["score_function"],
            "moe_router_enable_expert_bias": moe["router_expert_bias"],
            "moe_token_dispatcher_type": p["dispatcher"] if p["dispatcher"] != "flex" else "alltoall",
            "moe_grouped_gemm": False,
        } | load_balancing_kwargs(moe, router_bias_update(p))
        if moe["router_scaling_factor"]:
            kwargs["moe_router_topk_scaling_factor"] = moe["router_scaling_factor"]
        if moe.get("router_fp32"):
            kwargs["moe_router_dtype"] = "fp32"
        kwargs |= moe_overlap_kwargs(p, moe)
    return kwargs


def router_bias_update(p: dict[str, Any]) -> bool:
    """workload.json `parallel.router_bias_update` (default on): off, the expert bias stays at zero -- the routers
    still choose with it (so the model, its checkpoints and the all-reduce are unchanged) but finalize_model_grads
    moves it by 0 x sign(...). For control runs: what the load does without the update."""
    value = p.get("router_bias_update", True)
    if isinstance(value, str):
        value = value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


def load_balancing_kwargs(moe: dict[str, Any], bias_update: bool = True) -> dict[str, Any]:
    """megatron's auxiliary loss (aux_loss_coeff; 0: none), and with `expert_bias` the router bias that
    finalize_model_grads moves after every step by rate x sign(mean load - load) (the slice has both: catalog);
    `bias_update` False holds that bias at zero (rate 0: router_bias_update)."""
    coeff = moe.get("aux_loss_coeff", 1e-2)
    rate = moe["bias_update_rate"] if bias_update else 0.0
    bias = {"moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": rate}
    return {"moe_router_load_balancing_type": "aux_loss" if coeff > 0 else "none", "moe_aux_loss_coeff": coeff} | (
        bias if moe.get("load_balancing", "aux_loss") == "expert_bias" else {})


def keep_router_counts_fp32(models: list[Any]) -> int:
    """Float16Module casts every buffer to bf16, the routers' token counters too (megatron-core 0.16.1 keeps
    only the expert bias in fp32). A bf16 counter stops counting once a micro-batch's tokens for an expert fall
    below half its spacing (a count of 65,536 ignores any addition under 256), and the expert-bias update then
    reads wrong loads; back to fp32 here. -> counters converted"""
    converted = 0
    for model in models:
        for module in model.modules():
            counts = getattr(module, "local_tokens_per_expert", None)
            if isinstance(counts, torch.Tensor) and counts.dtype != torch.float32:
                counts.data = counts.data.float()
                converted += 1
    return converted


def parallel_sizes(cfg: dict[str, Any]) -> dict[str, int]:
    p = cfg["parallel"]
    sizes = {"tensor_model_parallel_size": p["tp"], "pipeline_model_parallel_size": p["pp"],
             "context_parallel_size": p["cp"], "expert_model_parallel_size": p["ep"],
             "expert_tensor_parallel_size": p["etp"]}
    if p.get("vpp", 1) > 1:
        sizes["virtual_pipeline_model_parallel_size"] = p["vpp"]
    return sizes


def sdpa_core_attention() -> type:
    """The core attention of every layer of a uniform model (full causal attention): attention.py's."""
    return attention.core_attention_class(None)


def choose_experts(config: Any, experts: str) -> str | None:
    """Set up the grouped experts when workload.json asks for them and they can run (None), else say why not
    (megatron's SequentialMLP then). Logs the choice."""
    grouped = experts.startswith("grouped_mm")  # grouped_mm (compiled elementwise), grouped_mm_eager
    reason = experts_grouped.unsupported_reason(config) if grouped else f"workload.json: {experts}"
    if reason is None:
        experts_grouped.ELEMENTWISE = "eager" if experts == "grouped_mm_eager" else "compile"
    chosen = f"torch._grouped_mm, {experts_grouped.ELEMENTWISE} elementwise" if reason is None else None
    log(dist.get_rank() if dist.is_initialized() else 0, f"MoE experts: {chosen or f'SequentialMLP ({reason})'}")
    return reason


def layer_specs(config: Any, normalization: str, experts: str = "grouped_mm", vp_stage: int | None = None) -> Any:
    """megatron-core's local (no-TE) decoder block spec with SDPA as every layer's core attention, norms that run
    under sequence parallelism (layers.LocalNorm), and MoE experts on torch._grouped_mm (experts_grouped.py) unless
    `experts` is "sequential" or it cannot run."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization,
                                       vp_stage=vp_stage)
    layers.sequence_parallel_norms(block)  # megatron's WrappedTorchNorm refuses sequence parallelism
    core = sdpa_core_attention()
    for spec in block.layer_specs:
        spec.submodules.self_attention.submodules.core_attention = core
    if config.num_moe_experts and choose_experts(config, experts) is None:
        experts_grouped.use_in_block_spec(block, config)
    return block


def model_specs(cfg: dict[str, Any], config: Any, vp_stage: int | None = None) -> tuple[Any, Any]:
    """The decoder block spec and the MTP block spec (None without MTP or off its stage): megatron's stock spec
    for a uniform model, layers.py's per-layer specs otherwise (Step-3.5-Flash)."""
    m, experts = cfg["model"], cfg["parallel"].get("experts", "grouped_mm")
    if m.get("uniform_attention", True) and not m["mtp_layers"]:
        return layer_specs(config, m["normalization"], experts, vp_stage), None
    if config.num_moe_experts and choose_experts(config, experts) is not None:
        experts = "sequential"
    rank = dist.get_rank() if dist.is_initialized() else 0
    for kind in sorted({(layer["attention"], layer["window"]) for layer in m["layers"] + m["mtp_layers"]}, key=str):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        log(rank, f"{kind[0]} attention layers: {attention.kernel_name(kind[1], device)}")
    return (layers.block_spec(cfg, config, experts, vp_stage),
            layers.mtp_block_spec(cfg, config, experts, vp_stage))


def _define_missing_te_names() -> None:
    """megatron-core 0.16.1 leaves moe_utils.te_general_gemm undefined without TransformerEngine (0.19 sets None)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_model(cfg: dict[str, Any], config: Any, pre_process: bool = True, post_process: bool = True,
                vp_stage: int | None = None) -> Any:
    """GPTModel of this rank's pipeline stage (of its virtual stage `vp_stage` with an interleaved pipeline)."""
    from megatron.core.models.gpt import GPTModel

    _define_missing_te_names()
    m = cfg["model"]
    block, mtp = model_specs(cfg, config, vp_stage)
    return GPTModel(config=config, transformer_layer_spec=block, mtp_block_spec=mtp,
                    vocab_size=m["vocab_size"], max_sequence_length=m["max_position_embeddings"],
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not m["untie_embeddings_and_output_weights"],
                    position_embedding_type=m["position_embedding_type"], vp_stage=vp_stage)


def ddp_config_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """megatron-core DistributedDataParallelConfig arguments from workload.json (pure). Gradients are reduced in
    fp32 (what megatron's training loop does for bf16), and averaged by NCCL inside the collective: megatron's
    default instead multiplies the whole unsharded fp32 gradient buffer by 1/DP before it (one more pass over
    8 B/param on the compute stream; measured 7.5 ms a step for the MoE proxy on 2 H200s, docs/benchmarks.md).
    With the distributed optimizer and overlap_param_gather, the parameters' all-gather after the optimizer step
    runs under the next forward (dispatched whole by ParamGather); otherwise the step waits for it (the planner
    settles which: plan.search.settle_param_gather)."""
    p = cfg["parallel"]
    return {"grad_reduce_in_fp32": True, "average_in_collective": True, "overlap_grad_reduce": p["overlap_grad_reduce"],
            "use_distributed_optimizer": p["distributed_optimizer"],
            "overlap_param_gather": bool(p.get("overlap_param_gather") and p["distributed_optimizer"]
                                         and p["overlap_grad_reduce"])}


def moe_overlap_kwargs(p: dict[str, Any], moe: dict[str, Any]) -> dict[str, Any]:
    """megatron-core's MoE communication overlap (pure). `overlap_moe_expert_parallel_comm` (the layout's; off
    unless given: megatron's combined 1F1B schedule, EP > 1) overlaps one micro-batch's expert-parallel all-to-all
    with another's compute; otherwise, where there is dispatcher communication to hide (EP x TP > 1, the alltoall
    dispatcher) and a shared expert, `moe_shared_expert_overlap` runs the shared expert on a side stream under
    the dispatch and combine (workload.json's parallel.moe_shared_expert_overlap: off turns it off)."""
    if p.get("overlap_moe_expert_parallel_comm"):
        return {"overlap_moe_expert_parallel_comm": True}
    shared = bool(moe["shared_expert_ffn_hidden_size"]) and p["dispatcher"] in ("alltoall", "flex")
    if shared and p["ep"] * p["tp"] > 1 and p.get("moe_shared_expert_overlap", True):
        return {"moe_shared_expert_overlap": True}
    return {}


def known_config_kwargs(kwargs: dict[str, Any], fields: Any, rank: int = 0) -> dict[str, Any]:
    """`kwargs` less the overlap options this megatron-core's TransformerConfig lacks (`fields`: its dataclass
    fields), each named in the log: the MoE overlaps are megatron-core's since 0.12-0.14, the engine runs 0.16.1."""
    optional = ("moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm")
    missing = [k for k in optional if k in kwargs and k not in fields]
    if kwargs.get("moe_token_dispatcher_type") != "alltoall" and kwargs.get("moe_shared_expert_overlap"):
        missing.append("moe_shared_expert_overlap")  # an override chose another dispatcher: megatron refuses it
    if missing:
        log(rank, f"running without {', '.join(missing)} (not in this megatron-core, or not with this dispatcher)")
    return {k: v for k, v in kwargs.items() if k not in missing}
