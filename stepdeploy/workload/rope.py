"""Rotary position embedding as one fused kernel each way, without TransformerEngine.

megatron-core applies RoPE to q and k with `rope_utils.apply_rotary_pos_emb`. Unfused (`_apply_rotary_pos_emb_bshd`)
that is about six element-wise kernels on each of q and k forward (multiply by cos, negate and concatenate halves,
multiply by sin, add, concatenate the unrotated part) and as many backward, each a full pass over [s, b, heads,
head dim]. With TransformerConfig.apply_rope_fusion it calls `rope_utils.fused_apply_rotary_pos_emb(t, freqs,
interleaved=...)` instead: TransformerEngine's kernel, and None where TE is absent (the GPU nodes have no TE), in
which case TransformerConfig refuses the flag.

`install()` puts a torch.compile'd version of megatron's own unfused formula there (inductor makes the whole
formula one kernel forward and one backward), so that megatron's fused path runs and TransformerConfig accepts the
flag. The arithmetic is megatron's; inductor keeps intermediates in fp32 where eager rounds each to bf16, so results
agree to bf16 rounding, not bit for bit. On a CPU tensor it runs eagerly (tests, the simulated cluster); where
torch.compile fails on a node, eagerly from then on, with one log line (compiled.py's `CompiledOrEager`).

Where TE is present its kernel stays (the planner's RoPE term was fitted on this module's). Packed sequences (thd,
`cu_seqlens`) would need TE's `fused_apply_rotary_pos_emb_thd`, which nothing here provides: the engine packs none.

Standard library + torch + compiled.py (+ megatron-core's rope_utils module for `install`).
"""

from __future__ import annotations

from typing import Any

import torch
from compiled import CompiledOrEager


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron's unfused RoPE (rotate-half, not interleaved, mscale 1): t [s, b, h, d], freqs [s, 1, 1, r] angles
    in fp32 with r <= d; the first r dims of each head rotate, the rest pass through."""
    rot = freqs.shape[-1]
    x, passthrough = t[..., :rot], t[..., rot:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    first, second = torch.chunk(x, 2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return torch.cat((x * cos + rotated * sin, passthrough), dim=-1)


# shapes differ per layer kind (heads, rotary dims): torch.compile's default dynamic=None generalises a dimension
# after its first recompile instead of hitting the recompile limit on a model with many kinds of layer
_KERNEL = CompiledOrEager(rope_bshd, "rope.py")


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False) -> torch.Tensor:
    """TE's `fused_apply_rotary_pos_emb` signature (sbhd), computed by `rope_bshd`: compiled on a GPU tensor."""
    del transpose_output_memory  # a layout hint TE itself ignores
    if interleaved:
        raise ValueError("rope.py's fused RoPE does rotate-half only, not rotary_interleaved")
    if t.device.type != "cuda":  # the device itself, not is_cuda (which a CPU test of the offload redefines)
        return rope_bshd(t, freqs)
    return _KERNEL(t, freqs)


def prepare(config_kwargs: dict[str, Any]) -> str | None:
    """Before TransformerConfig(**config_kwargs): where they ask for apply_rope_fusion, `install` and say whose
    kernel runs (the engine logs it); None where they do not."""
    if not config_kwargs.get("apply_rope_fusion"):
        return None
    return "RoPE fusion: " + ("rope.py's compiled kernel" if install() else "TransformerEngine's kernel")


def install() -> bool:
    """Make megatron-core's fused RoPE path run this module's kernel where TransformerEngine's is absent. Call before
    building TransformerConfig with apply_rope_fusion. -> True when this module's kernel is the one megatron uses
    (False: TE's is there, and stays)."""
    from megatron.core.models.common.embeddings import rope_utils

    current = rope_utils.fused_apply_rotary_pos_emb
    if current is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
        return True
    return current is fused_apply_rotary_pos_emb
