"""Activation bytes one GPU keeps for backward, per layer and micro-batch, with MoE widths and top-k routing.

Counts the tensors autograd saves in a megatron-core layer with SDPA/flash attention (no s^2 score
matrix) and no dropout, in bf16 (fp32 where noted). Unlike Megatron's theoretical_memory_usage.py,
MoE layers use the expert width and k routed copies of every token, not the dense FFN width.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.catalog import ModelSpec
from stepdeploy.plan.layout import Layout
from stepdeploy.plan.params import LayerParams

BF16 = 2
FP32 = 4


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
    hidden = 2 * spec.hidden_size * BF16 * shards.hidden  # norm input, QKV input
    qkv = (q_width + 2 * kv_width) * BF16 + q_width * BF16  # q, k, v and the core-attention output
    stats = 0 if selective else heads * FP32  # softmax log-sum-exp, recomputed under selective
    gate = 2 * heads * BF16 if spec.attention_gate == "per_head" else 0
    return hidden + shards.attention * (qkv + stats + gate) / tp


def _dense_mlp(spec: ModelSpec, width: int, layout: Layout, shards: TokenShards) -> float:
    gated = 2 if spec.gated_linear_unit else 1
    hidden = 2 * spec.hidden_size * BF16 * shards.hidden  # norm input, fc1 input
    return hidden + shards.attention * (gated * width + width) * BF16 / layout.tp  # fc1 out, act out


def _moe(spec: ModelSpec, layout: Layout, shards: TokenShards, selective: bool) -> float:
    moe = spec.moe
    assert moe is not None
    h, gated = spec.hidden_size, 2 if spec.gated_linear_unit else 1
    local_tokens = shards.hidden  # tokens this rank routes (its sequence-parallel shard)
    hidden = 2 * h * BF16 * local_tokens  # norm input, router input
    router = 2 * moe.num_experts * FP32 * local_tokens  # logits and scores
    rows = local_tokens * moe.topk  # token copies this GPU computes after dispatch (balanced)
    act = 0 if selective else moe.ffn_hidden_size  # moe_act is recomputed under selective
    routed = rows * (layout.etp * 2 * h + gated * moe.ffn_hidden_size + act) * BF16  # fc1 in, combine in
    shared = 0.0
    if moe.shared_expert_ffn_hidden_size:
        width = moe.shared_expert_ffn_hidden_size
        shared = shards.attention * (gated * width + width) * BF16 / layout.tp
    return hidden + router + routed + shared


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
        total += _moe(spec, layout, shards, selective)
    else:
        total += _dense_mlp(spec, spec.ffn_hidden_size, layout, shards)
    if layer.mtp_extra:
        total += 4 * spec.hidden_size * BF16 * shards.hidden  # enorm/hnorm inputs, eh_proj input (2h)
    return total


def in_flight_microbatches(layout: Layout, stage: int, microbatches: int) -> float:
    """Micro-batches whose activations a stage holds at the peak of 1F1B (or interleaved 1F1B).

    Interleaved: rank r runs 2(PP-r-1) + (VPP-1)PP warm-up chunks, each 1/VPP of its layers; rank 0 thus
    holds PP*(1 + (PP-1)/(PP*VPP)) micro-batches' worth, Megatron's own interleaving factor.
    """
    pp, vpp = layout.pp, layout.vpp
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - stage, microbatches))
    chunks = 2 * (pp - stage - 1) + (vpp - 1) * pp + 1
    return min(chunks, microbatches * vpp) / vpp


def logits_bytes(spec: ModelSpec, layout: Layout, seq_length: int) -> float:
    """Last stage: bf16 logits + fp32 softmax of the vocab-parallel cross entropy, per MTP head too."""
    tokens = layout.mbs * seq_length / layout.cp
    heads = 1 + spec.mtp_num_layers
    return heads * tokens * spec.vocab_size / layout.tp * (BF16 + FP32)
