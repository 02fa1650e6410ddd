"""Sliding-window and full attention kernels at Step-3.5-Flash's shapes, on the GPU: which kernel the engine uses,
and that its window is right.

    python3 bench/gpu_attention.py --out attention.json       # on the H200 machine (torch only)

Shapes: batch B (default 1, a 4,096-token micro-batch; --batch), seq 4096, head dim 128, 8 KV groups; sliding
layers 96 query heads with a window of 512 keys (the query itself included), full layers 64 heads, causal. Each
candidate runs forward + backward (CUDA events, after warm-up); TFLOP/s count what the layer computes (4 x heads x
d x the keys each query sees, x 3 for forward + backward: the window's average context, or (s+1)/2 causal).
Candidates: the engine's own path (stepdeploy/workload/attention.py: FlexAttention with a block mask for windows,
SDPA causal for full layers), SDPA with an explicit window mask (a dense masked attention), FlexAttention for the
full layers, and flash-attn 2's window_size / flash-attn 4 where they import (reported as unavailable otherwise).

Correctness (bf16 inputs): the engine's window kernel against a naive masked attention computed in fp32 from the
same inputs -- the output and the three input gradients -- and an edge probe: with q = 0 every allowed key weighs
the same, and with v_j = j a query's output is the mean position of its keys, which is exact for window [i-W+1, i]
and off by 0.5 for a window one key wider or narrower.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stepdeploy" / "workload"))
import attention  # the engine's own module, shipped as a file
from gpu_experts import timed  # bench/: the same CUDA-event timing

SEQ, D, GROUPS, WINDOW = 4096, 128, 8, 512


def context(seq: int, window: int | None) -> float:
    """Average keys per query: causal within the window (the query itself included)."""
    if window is None or window >= seq:
        return (seq + 1) / 2
    return window - window * (window - 1) / (2 * seq)


def fwd_bwd_ms(fn: Any, args: list[torch.Tensor], repeat: int = 20) -> float:
    """Mean ms of forward + backward (after 3 warm-ups), timed by CUDA events (gpu_experts.timed)."""
    def once() -> None:
        out = fn(*args)
        out.backward(torch.ones_like(out))
        for a in args:
            a.grad = None

    return timed(once, True, 3, repeat) * 1e3


def inputs(batch: int, heads: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, SEQ, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(batch, GROUPS, SEQ, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(batch, GROUPS, SEQ, D, device="cuda", dtype=dtype, generator=g)
    return [t.requires_grad_() for t in (q, k, v)]


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Masked softmax attention in fp32, grouped heads expanded."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2], device=q.device)
    allowed = i[:, None] >= i[None, :]
    if window is not None:
        allowed &= (i[:, None] - i[None, :]) < window
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def candidates(window: int | None) -> dict[str, Any]:
    def engine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention.attend(q, k, v, window, None)

    def sdpa_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = attention.window_mask(q.shape[2], window or q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention.flex_attention_compiled()(q, k, v, block_mask=attention.sliding_block_mask(
            q.shape[2], window or q.shape[2], q.device), enable_gqa=True)

    found: dict[str, Any] = {"engine": engine, "sdpa_dense_mask": sdpa_mask}
    if window is None:
        found["flex_causal"] = flex
    try:
        from flash_attn import flash_attn_func

        def fa2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            left = -1 if window is None else window - 1
            out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, window_size=(left, 0))
            return out.transpose(1, 2)

        found["flash_attn_2"] = fa2
    except ImportError as exc:
        found["flash_attn_2"] = f"unavailable: {exc}"
    try:
        from flash_attn.cute import flash_attn_func as fa4_func

        def fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            left = None if window is None else window - 1
            out = fa4_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, window_size=(left, 0))
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

        found["flash_attn_4"] = fa4
    except ImportError as exc:
        found["flash_attn_4"] = f"unavailable: {exc}"
    return found


def correctness(batch: int) -> dict[str, Any]:
    q, k, v = inputs(batch, 96)
    out = attention.attend(q, k, v, WINDOW, None)
    weights = torch.randn_like(out)
    (out.float() * weights).sum().backward()
    got = [out.detach().float(), *(t.grad.float() for t in (q, k, v))]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = naive(q2, k2, v2, WINDOW)
    (ref * weights).sum().backward()
    want = [ref.detach(), *(t.grad.float() for t in (q2, k2, v2))]
    names = ("output", "dq", "dk", "dv")
    errors = {n: float((a - b).abs().max() / b.abs().max()) for n, a, b in zip(names, got, want, strict=True)}
    # the edge probe: q = k = 0 weighs every allowed key alike; v_j is one-hot at dim j mod 128, so output dim d of
    # query i is (allowed keys j = d mod 128) / (allowed keys) -- exact in bf16 where the window is full (4/512),
    # and a window one key wider or narrower moves some dim by more than 0.0015
    zeros = torch.zeros(1, 96, SEQ, D, device="cuda", dtype=torch.bfloat16)
    kk = torch.zeros(1, GROUPS, SEQ, D, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(SEQ, device="cuda")
    onehot = F.one_hot(positions % D, D).to(torch.bfloat16).view(1, 1, SEQ, D).expand(1, GROUPS, SEQ, D)
    probe = attention.attend(zeros, kk, onehot.contiguous(), WINDOW, None)[0, 0].float()  # [s, d]

    def expected(width: int) -> torch.Tensor:
        first = torch.clamp(positions - (width - 1), min=0)
        counts = torch.stack([_count(first, positions, d) for d in range(D)], dim=-1)
        return counts.float() / (positions - first + 1).float().unsqueeze(-1)

    exact = expected(WINDOW)
    off = (probe - exact).abs()
    return {"relative_error": errors, "edge_probe_max_abs_error": float(off.max()),
            "edge_probe_error_near_start": float(off[:WINDOW].max()),
            "edge_probe_error_past_window": float(off[WINDOW:].max()),
            "one_key_wider_would_be_off_by": float((expected(WINDOW + 1) - exact).abs().max()),
            "one_key_narrower_would_be_off_by": float((expected(WINDOW - 1) - exact).abs().max())}


def _count(first: torch.Tensor, last: torch.Tensor, d: int) -> torch.Tensor:
    """How many j in first..last (elementwise ranges) have j % D == d."""
    def upto(n: torch.Tensor) -> torch.Tensor:  # j in 0..n-1
        return torch.where(n > d, (n - d + D - 1) // D, torch.zeros_like(n))
    return upto(last + 1) - upto(first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    result: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                              "batch": args.batch, "seq": SEQ, "window": WINDOW}
    started = time.time()
    result["correctness"] = correctness(args.batch)
    for label, heads, window in (("sliding (96 heads, window 512)", 96, WINDOW), ("full (64 heads, causal)", 64, None)):
        flops = 3 * 4 * args.batch * heads * D * SEQ * context(SEQ, window)
        rows = {}
        for name, fn in candidates(window).items():
            if isinstance(fn, str):
                rows[name] = {"status": fn}
                continue
            try:
                ms = fwd_bwd_ms(fn, inputs(args.batch, heads))
                rows[name] = {"ms_fwd_bwd": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
            except Exception as exc:  # a candidate that fails is reported, not fatal
                rows[name] = {"status": f"failed: {type(exc).__name__}: {str(exc)[:300]}"}
            print(label, name, rows[name], flush=True)
        result[label] = rows
    result["wall_s"] = round(time.time() - started, 1)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["correctness"]))


if __name__ == "__main__":
    main()
