"""Core attention for the megatron engine: softmax(q k^T / sqrt(d)) v of one layer, causal, with grouped-query
heads, over the whole sequence or a sliding window, and an optional per-head output gate.

Kernels (each a fused one on the GPU; megatron-core's own local attention without TransformerEngine is unfused):
- full causal attention: flash-attn's flash_attn_func when flash-attn imports, otherwise torch SDPA (which picks
  its flash or cuDNN kernel on Hopper);
- sliding-window attention: torch FlexAttention, compiled, with a block mask that skips every tile outside the
  window. On one H200 (Step-3.5-Flash's shapes, docs/benchmarks.md) it ran 6x faster than SDPA with an explicit
  window mask. FlexAttention has no backward on the CPU: there (the test suite) the window runs as SDPA with a
  boolean mask -- correct, and never the timed path.

A window of W keys includes the query itself (HF's sliding_window convention): query i sees keys i-W+1 .. i.
The per-head gate (Step-3.5-Flash's g_proj) arrives as the gate's logits [s, b, heads] in megatron's
`attention_bias` argument, the one per-call tensor SelfAttention hands its core attention (layers.py sends it),
and each head's output is multiplied by sigmoid(logit). Standard library + torch + megatron-core only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_BLOCK_MASKS: dict[tuple[int, int, str], Any] = {}
_FLEX: list[Any] = []  # the compiled flex_attention, built on first use


def flash_attn_func() -> Any:
    """flash-attn's flash_attn_func when the package imports (it is optional), else None."""
    try:
        from flash_attn import flash_attn_func as func
    except ImportError:
        return None
    return func


def kernel_name(window: int | None, device: torch.device | str) -> str:
    """What runs a layer's attention on `device` (logged at start-up, so a run states its kernels)."""
    on_gpu = torch.device(device).type == "cuda"
    if window is not None:
        return "FlexAttention (sliding-window block mask)" if on_gpu else "SDPA with a window mask (CPU)"
    return "flash-attn" if on_gpu and flash_attn_func() is not None else "torch SDPA (causal)"


def window_mask(seq: int, window: int, device: torch.device | str) -> torch.Tensor:
    """[seq, seq] booleans, True where query i may see key j: i - window < j <= i."""
    i = torch.arange(seq, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


def sliding_block_mask(seq: int, window: int, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    key = (seq, window, str(device))
    if key not in _BLOCK_MASKS:
        def inside(_b: Any, _h: Any, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return (q >= kv) & (q - kv < window)

        _BLOCK_MASKS[key] = create_block_mask(inside, None, None, seq, seq, device=device)
    return _BLOCK_MASKS[key]


def flex_attention_compiled() -> Any:
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
           scale: float | None) -> torch.Tensor:
    """q [b, heads, s, d], k and v [b, groups, s, d] -> [b, heads, s, d], causal (within `window` keys)."""
    gqa = k.shape[1] != q.shape[1]
    if window is None or window >= q.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q.is_cuda:
        mask = sliding_block_mask(q.shape[2], window, q.device)
        return flex_attention_compiled()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(q.shape[2], window, q.device),
                                          scale=scale, enable_gqa=gqa)


def apply_head_gate(out: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """out [s, b, heads, d] times sigmoid(gate_logits [s, b, heads]) per head."""
    return out * torch.sigmoid(gate_logits.float()).to(out.dtype).unsqueeze(-1)


def core_attention_class(window: int | None = None) -> type:
    """A core-attention module with megatron DotProductAttention's interface for layers of one kind (a window
    of `window` keys, or full causal attention). Built when called (importing this file needs no megatron),
    looking for flash-attn then."""
    from megatron.core.transformer.module import MegatronModule

    flash = flash_attn_func()

    class CoreAttention(MegatronModule):
        uses_flash_attn = flash is not None and window is None
        window_size = window

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str = "self",
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     **_ignored: Any) -> None:
            super().__init__(config=config)
            self.softmax_scale = softmax_scale
            self.layer_number = layer_number

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: torch.Tensor | None = None,
                    packed_seq_params: Any = None, **_extra: Any) -> torch.Tensor:
            seq, batch = query.shape[0], query.shape[1]
            if self.uses_flash_attn and query.dtype in (torch.bfloat16, torch.float16):
                q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [s, b, n, d] -> [b, s, n, d]
                out = flash(q, k, v, softmax_scale=self.softmax_scale, causal=True).transpose(0, 1)
            else:
                q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
                out = attend(q, k, v, self.window_size, self.softmax_scale).permute(2, 0, 1, 3)
            if attention_bias is not None:  # the per-head gate's logits (layers.py), not an additive bias
                out = apply_head_gate(out, attention_bias)
            return out.reshape(seq, batch, -1)

    CoreAttention.__name__ = CoreAttention.__qualname__ = "SdpaAttention" if window is None else "WindowAttention"
    return CoreAttention
