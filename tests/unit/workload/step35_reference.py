"""An independent fp32 reference of Step-3.5-Flash's layers in plain torch, written from the published architecture
(the Hugging Face config.json fields and modeling_step3p5.py's semantics; shared/FACTS.md), not from megatron-core
or the engine: the engine's layers are checked against it (test_step35_equivalence.py).

Tensors are [batch, seq, hidden]; weights are plain tensors in HF's own layout (q_proj [heads*d, h], ...), held in a
dict per layer, so that gradients can be read per weight. Conventions, each from the HF code:
- RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + w), in fp32; q_norm / k_norm over each head's dims, before RoPE;
- RoPE: per layer theta and rotated fraction; inv_freq over the rotated dims only; half rotation (rotate_half)
  of the first `dim` dims of each head, the rest passed through; llama3 scaling on the layers that have it;
- attention: causal; a sliding layer's query i sees keys i-W+1 .. i; grouped-query heads (kv head = head // rep);
  one sigmoid gate per head (g_proj) on the attention output before o_proj;
- MoE: sigmoid of fp32 router logits; router_bias added for choosing the top k only; the chosen (unbiased)
  scores renormalised to sum 1, then times the scaling factor; routed experts plus the shared expert, ungated;
- SwiGLU: silu(gate) * up, with a limit L: min(silu(gate), L) * clamp(up, -L, L);
- MTP layer: eh_proj(cat[enorm(embedding), hnorm(hidden)]), a decoder layer, then its own final norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

EPS = 1e-5


@dataclass
class Switches:
    """Features of the reference that a test can turn off, to show each one matters (the check must then fail)."""

    head_gate: bool = True
    window: bool = True
    window_edge: bool = True  # off: one key more (megatron's window_size=(W, 0) convention admits W + 1)
    layer_rope: bool = True  # each layer kind its own theta and rotated fraction (off: theta 10000, all dims)
    llama3: bool = True
    zero_centered: bool = True
    qk_norm: bool = True
    router_bias: bool = True
    renormalise: bool = True
    clamp: bool = True
    shared_expert: bool = True
    mtp_concat_embedding_first: bool = True
    disabled: set[str] = field(default_factory=set)

    def without(self, name: str) -> Switches:
        return Switches(**{**self.__dict__, name: False, "disabled": {*self.disabled, name}})


def rms_norm(x: torch.Tensor, w: torch.Tensor, sw: Switches) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return normed * ((1.0 + w.float()) if sw.zero_centered else w.float())


def rope_frequencies(rope: dict[str, Any], head_dim: int, sw: Switches) -> torch.Tensor:
    theta = rope["theta"] if sw.layer_rope else 10000.0
    dim = int(head_dim * rope["rotary_percent"]) if sw.layer_rope else head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = rope.get("llama3_scaling") if sw.llama3 else None
    if not scaling:
        return inv_freq
    # transformers' _compute_llama3_parameters, step by step
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, inv_freq_llama)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d]: rotate its first 2 x len(inv_freq) dims by position."""
    positions = torch.arange(x.shape[2], dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    dim = emb.shape[-1]
    rotated, passed = x[..., :dim], x[..., dim:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)


def attention(x: torch.Tensor, w: dict[str, torch.Tensor], layer: dict[str, Any], groups: int, head_dim: int,
              sw: Switches) -> torch.Tensor:
    b, s, _ = x.shape
    heads = layer["num_heads"]
    q = (x @ w["q_proj"].T).view(b, s, heads, head_dim)
    k = (x @ w["k_proj"].T).view(b, s, groups, head_dim)
    v = (x @ w["v_proj"].T).view(b, s, groups, head_dim).transpose(1, 2)
    if sw.qk_norm:
        q, k = rms_norm(q, w["q_norm"], sw), rms_norm(k, w["k_norm"], sw)
    inv_freq = rope_frequencies(layer["rope"], head_dim, sw)
    q, k = apply_rope(q.transpose(1, 2), inv_freq), apply_rope(k.transpose(1, 2), inv_freq)
    rep = heads // groups
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
    i = torch.arange(s)
    allowed = i[:, None] >= i[None, :]
    if layer["window"] is not None and sw.window:
        allowed &= (i[:, None] - i[None, :]) < layer["window"] + (0 if sw.window_edge else 1)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = (probs @ v).transpose(1, 2)  # [b, s, heads, d]
    if sw.head_gate:
        out = out * torch.sigmoid(x @ w["g_proj"].T).unsqueeze(-1)
    return out.reshape(b, s, heads * head_dim) @ w["o_proj"].T


def swiglu(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, limit: float | None,
           sw: Switches) -> torch.Tensor:
    gate, up = F.silu(x @ gate_w.T), x @ up_w.T
    if limit and sw.clamp:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (gate * up) @ down_w.T


def moe(x: torch.Tensor, w: dict[str, Any], layer: dict[str, Any], moe_cfg: dict[str, Any],
        sw: Switches) -> torch.Tensor:
    b, s, h = x.shape
    tokens = x.reshape(-1, h)
    scores = torch.sigmoid(tokens.float() @ w["gate"].float().T)
    choose = scores + w["router_bias"] if sw.router_bias else scores
    chosen = torch.topk(choose, moe_cfg["topk"], dim=-1).indices
    weights = torch.gather(scores, 1, chosen)
    if sw.renormalise:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * moe_cfg["router_scaling_factor"]
    out = torch.zeros_like(tokens)
    for expert in range(moe_cfg["num_experts"]):
        rows, slot = torch.nonzero(chosen == expert, as_tuple=True)
        if rows.numel():
            e = w["experts"][expert]
            y = swiglu(tokens[rows], e["gate_proj"], e["up_proj"], e["down_proj"], layer["swiglu_limit"], sw)
            out = out.index_add(0, rows, y * weights[rows, slot].unsqueeze(-1))
    if sw.shared_expert:
        sh = w["shared"]
        out = out + swiglu(tokens, sh["gate_proj"], sh["up_proj"], sh["down_proj"], layer["shared_swiglu_limit"], sw)
    return out.view(b, s, h)


def decoder_layer(x: torch.Tensor, w: dict[str, Any], layer: dict[str, Any], model: dict[str, Any],
                  sw: Switches) -> torch.Tensor:
    groups, head_dim = model["num_query_groups"], model["kv_channels"]
    h = x + attention(rms_norm(x, w["input_layernorm"], sw), w["attn"], layer, groups, head_dim, sw)
    normed = rms_norm(h, w["post_attention_layernorm"], sw)
    if layer["ffn"] == "moe":
        return h + moe(normed, w["moe"], layer, model["moe"], sw)
    mlp = w["mlp"]
    return h + swiglu(normed, mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"], layer["shared_swiglu_limit"], sw)


def mtp_layer(embedding: torch.Tensor, hidden: torch.Tensor, w: dict[str, Any], layer: dict[str, Any],
              model: dict[str, Any], sw: Switches) -> torch.Tensor:
    """One MTP module: the next tokens' embeddings and the previous hidden states in, normed hidden states out."""
    e, hh = rms_norm(embedding, w["enorm"], sw), rms_norm(hidden, w["hnorm"], sw)
    joined = torch.cat((e, hh) if sw.mtp_concat_embedding_first else (hh, e), dim=-1)
    x = joined @ w["eh_proj"].T
    return rms_norm(decoder_layer(x, w["layer"], layer, model, sw), w["final_norm"], sw)


def model_losses(tokens: torch.Tensor, w: dict[str, Any], model: dict[str, Any], sw: Switches) -> torch.Tensor:
    """Per-token cross entropy of the main model's next-token prediction, [b, s] (tokens [b, s + 1])."""
    x = w["embedding"][tokens[:, :-1]]
    for layer_w, layer in zip(w["layers"], model["layers"], strict=True):
        x = decoder_layer(x, layer_w, layer, model, sw)
    logits = rms_norm(x, w["final_norm"], sw) @ w["output"].T
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
