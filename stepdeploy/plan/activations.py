"""Activation bytes one GPU keeps for backward, per layer and micro-batch, with MoE widths and top-k routing.

Counts the tensors autograd saves in a megatron-core layer with SDPA/flash attention (no s^2 score
matrix) and no dropout, in bf16 (fp32 where noted). Unlike Megatron's theoretical_memory_usage.py,
MoE layers use the expert width and k routed copies of every token, not the dense FFN width.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.catalog import ModelSpec
from stepdeploy.plan.layout import Layout, vpp_group_size
from stepdeploy.plan.params import LayerParams

BF16 = 2
FP32 = 4
# With EP > 1 the busiest rank's experts get more than their 1/EP share of the routed rows (the router is not
# balanced early in training); the peak is the max over ranks. Measured on 2 x H200, proxy-0.7b-moe EP2 MBS 4
# (2026-11-29): 1.25x (SequentialMLP, 16 iterations, docs/benchmarks.md) and 1.49x (grouped_mm, 6 iterations,
# docs/planner.md) from the peaks; 1.35 predicts both within 2.5 %.
EP_ROUTING_IMBALANCE = 1.35


@dataclass(frozen=True)
class TokenShards:
    """Tokens of one micro-batch on one GPU: `attention` in the layer, `hidden` for h-wide tensors."""

    attention: float  # mbs * seq / CP
    hidden: float  # divided further by TP under sequence parallelism


def token_shards(seq_length: int, layout: Layout) -> TokenShards:
    tokens = layout.mbs * seq_length / layout.cp
    return TokenShards(attention=tokens, hidden=tokens / layout.tp if layout.sp else tokens)


def _attention(
    spec: ModelSpec, layer: LayerParams, layout: Layout, shards: TokenShards, selective: bool
) -> float:
    heads, d, tp = layer.shape.num_heads, spec.kv_channels, layout.tp
    q_width, kv_width = heads * d, spec.num_query_groups * d
    hidden = 2 * spec.hidden_size * BF16 * shards.hidden  # norm input, QKV input (SP: the local shard)
    # The fused QKV output stays alive whole: v is a view of it that SDPA saves. RoPE makes new q and k.
    qkv = (q_width + 2 * kv_width) * BF16
    rope = (q_width + kv_width) * BF16 if spec.position_embedding_type == "rope" else 0
    core_out = q_width * BF16  # SDPA output = linear_proj input (the [b,n,s,d] -> [s,b,h] reshape is a view)
    stats = 0 if selective else heads * FP32  # softmax log-sum-exp; selective recomputes core attention
    gate = 2 * heads * BF16 if spec.attention_gate == "per_head" else 0
    return hidden + shards.attention * (qkv + rope + core_out + stats + gate) / tp


def mlp_saved_per_row(width: int, gated: bool, probs: bool) -> float:
    """Bytes one token row saves inside an MLP of `width` (local spec, no fusions), input excluded.

    fc1 output (saved by the activation; 2 x width for GLU, whose halves are views of it), activation
    output (saved by fc2, or by the GLU product), GLU product, and for routed experts the activation
    scaled by the router probability (megatron applies the probabilities inside the expert: the product
    is saved by fc2, the unscaled activation by the multiplication).
    """
    saved = (2 * width if gated else width) + width
    if gated:
        saved += width
    if probs:
        saved += width
    return saved * BF16


def _dense_mlp(spec: ModelSpec, width: int, layout: Layout, shards: TokenShards) -> float:
    hidden = 2 * spec.hidden_size * BF16 * shards.hidden  # norm input, fc1 input
    return hidden + shards.attention * mlp_saved_per_row(width, spec.gated_linear_unit, False) / layout.tp


def _moe(spec: ModelSpec, layout: Layout, shards: TokenShards) -> float:
    moe = spec.moe
    assert moe is not None
    h = spec.hidden_size
    local_tokens = shards.hidden  # tokens this rank routes (its sequence-parallel shard)
    hidden = 2 * h * BF16 * local_tokens  # norm input, norm output (router and dispatcher input)
    router = 2 * moe.num_experts * FP32 * local_tokens  # logits and scores
    imbalance = EP_ROUTING_IMBALANCE if layout.ep > 1 else 1.0
    rows = local_tokens * moe.topk * imbalance  # token copies this GPU's experts compute after dispatch
    # ETP: each rank of an expert's ETP group sees all of the group's rows at width F / ETP.
    if layout.grouped_experts:  # experts_grouped.py saves its input and fc1's output, recomputes the rest
        saved = (2 if spec.gated_linear_unit else 1) * moe.ffn_hidden_size * BF16
    else:
        saved = mlp_saved_per_row(moe.ffn_hidden_size, spec.gated_linear_unit, True)
    per_row = layout.etp * h * BF16 + saved
    shared = 0.0
    if moe.shared_expert_ffn_hidden_size:
        width = moe.shared_expert_ffn_hidden_size
        shared = shards.attention * mlp_saved_per_row(width, spec.gated_linear_unit, False) / layout.tp
    return hidden + router + rows * per_row + shared


def layer_activation_bytes(spec: ModelSpec, layer: LayerParams, layout: Layout, seq_length: int) -> float:
    """Bytes saved for backward by one layer for one micro-batch, under the layout's recompute mode."""
    shards = token_shards(seq_length, layout)
    if layout.recompute == "full":
        return spec.hidden_size * BF16 * shards.hidden  # only the layer input is kept
    return full_layer_bytes(spec, layer, layout, seq_length, selective=layout.recompute == "selective")


def full_layer_bytes(
    spec: ModelSpec, layer: LayerParams, layout: Layout, seq_length: int, selective: bool = False
) -> float:
    shards = token_shards(seq_length, layout)
    total = _attention(spec, layer, layout, shards, selective)
    if layer.shape.ffn == "moe":
        total += _moe(spec, layout, shards)
    else:
        total += _dense_mlp(spec, spec.ffn_hidden_size, layout, shards)
    if layer.mtp_extra:
        total += 4 * spec.hidden_size * BF16 * shards.hidden  # enorm/hnorm inputs, eh_proj input (2h)
    return total


def in_flight_microbatches(layout: Layout, stage: int, microbatches: int) -> float:
    """Micro-batches whose activations a stage holds at the peak of 1F1B (or interleaved 1F1B).

    Interleaved: rank r runs 2(PP-r-1) + (VPP-1)G warm-up chunks, each 1/VPP of its layers, G the micro-batch
    group per virtual stage (layout.vpp_group_size: PP where PP divides the micro-batches); with G = PP rank 0
    holds PP*(1 + (PP-1)/(PP*VPP)) micro-batches' worth, Megatron's own interleaving factor.
    """
    pp, vpp = layout.pp, layout.vpp
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - stage, microbatches))
    group = vpp_group_size(microbatches, pp) or pp
    chunks = 2 * (pp - stage - 1) + (vpp - 1) * group + 1
    return min(chunks, microbatches * vpp) / vpp


def logits_bytes(spec: ModelSpec, layout: Layout, seq_length: int) -> float:
    """Last stage: per head (the main one and every MTP one), the final-norm input and output-layer input (h wide,
    SP-sharded), the bf16 logits and the fp32 copy that the vocab-parallel cross entropy turns into the saved
    softmax, all alive from the end of the forward pass until that head's backward; and, for one head at a time
    (its backward), the fused cross entropy's extra fp32 copy: measured +1.00 GiB at MBS 4 and +2.09 GiB at MBS 8
    on the dense proxy (32768 vocab, seq 2048); with step-3.5-flash-slice-1gpu's two heads (128,896 vocab, seq
    4096) this puts the peaks at MBS 1, 2, 4 within 2.4 % of the measured 70.51, 82.38, 107.04 GiB, where an extra
    copy per head over-predicted them by up to 8.7 % (docs/benchmarks.md, 2026-12-01)."""
    shards = token_shards(seq_length, layout)
    heads = 1 + spec.mtp_num_layers
    head_inputs = 2 * spec.hidden_size * BF16 * shards.hidden
    entries = shards.attention * spec.vocab_size / layout.tp
    fused_extra = entries * FP32 if layout.cross_entropy_fusion else 0.0
    return heads * (head_inputs + entries * (BF16 + FP32)) + fused_extra
