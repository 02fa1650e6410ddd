"""MoE experts: stepdeploy's GroupedMMExperts (torch._grouped_mm) against megatron-core's SequentialMLP.

(a) numerics: the same weights, tokens, probs and output gradient through both, bf16; max abs / relative
    differences of the output and of the gradients (input, probs, fc1, fc2), and each one's error against an
    fp32 per-expert reference (so a difference can be told from an error);
(b) speed: forward+backward (and forward alone) timed with CUDA events, TFLOP/s by the GEMM FLOP count
    (2 * tokens * (hidden * fc1_out + ffn * hidden) forward, twice that backward), peak memory above the inputs.

The default shape is the proxy-0.7b-moe layer on one GPU at micro-batch 4: 8 experts, hidden 2048, expert ffn
8192, GELU, 4 x 2048 tokens routed top-2 (16384 routed rows) with an uneven, realistic split.

    PYTHONPATH=/path/to/megatron-core python3 bench/gpu_experts.py --out $OUT/experts.json   # H200
    python3 bench/gpu_experts.py --tiny --out /tmp/experts.json                              # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stepdeploy" / "workload"))
import experts_grouped


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON results (rewritten after each phase)")
    parser.add_argument("--tiny", action="store_true", help="small shape, runs on CPU (smoke test)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=4 * 2048, help="tokens before routing (mbs x seq)")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--glu", action="store_true", help="SwiGLU experts instead of GELU")
    parser.add_argument("--skew", type=float, default=0.5, help="std of a per-expert router bias (imbalance)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if args.tiny:
        args.experts, args.hidden, args.ffn, args.tokens, args.warmup, args.iters = 4, 64, 128, 192, 1, 2
    return args


def setup(cuda: bool) -> None:
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)


def make_config(args: argparse.Namespace, cuda: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=16 if args.hidden % 16 == 0 else 4,
        ffn_hidden_size=args.ffn, num_moe_experts=args.experts, moe_ffn_hidden_size=args.ffn,
        moe_router_topk=args.topk, gated_linear_unit=args.glu, activation_func=F.silu if args.glu else F.gelu,
        add_bias_linear=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=not cuda)


def build(config: Any, experts: int) -> tuple[Any, Any]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    groups = get_default_pg_collection()
    seq = SequentialMLP(experts, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                       linear_fc2=RowParallelLinear), pg_collection=groups)
    ours = experts_grouped.experts_class()(experts, config, pg_collection=groups)
    with torch.no_grad():
        for e, expert in enumerate(seq.local_experts):
            ours.weight1[e].copy_(expert.linear_fc1.weight.t())
            ours.weight2[e].copy_(expert.linear_fc2.weight.t())
    return seq, ours


def routing(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """Top-k of softmax router scores with a per-expert bias: uneven counts, as a router early in training."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(args.tokens, args.experts, generator=gen) + args.skew * torch.randn(args.experts,
                                                                                               generator=gen)
    top, idx = torch.softmax(logits, -1).topk(args.topk, dim=-1)
    counts = torch.bincount(idx.flatten(), minlength=args.experts)
    routed = int(counts.sum())
    probs = top.flatten()[torch.argsort(idx.flatten(), stable=True)]  # permuted (expert-major) order
    x = torch.randn(routed, args.hidden, generator=gen).to(torch.bfloat16)
    grad = (torch.randn(routed, args.hidden, generator=gen) * 0.01).to(torch.bfloat16)
    return {"x": x.to(device), "probs": probs.float().to(device), "counts": counts, "grad": grad.to(device)}


def without_expert(data: dict[str, torch.Tensor], expert: int) -> dict[str, torch.Tensor]:
    """The same routed rows, less those of one expert (a local expert that receives no token)."""
    counts = data["counts"].clone()
    start = int(counts[:expert].sum())
    keep = torch.ones(int(counts.sum()), dtype=torch.bool)
    keep[start:start + int(counts[expert])] = False
    counts[expert] = 0
    keep = keep.to(data["x"].device)
    return {"x": data["x"][keep], "probs": data["probs"][keep], "counts": counts, "grad": data["grad"][keep]}


def gemm_only(args: argparse.Namespace, ours: Any, data: dict[str, torch.Tensor], cuda: bool) -> dict[str, Any]:
    """The six grouped GEMMs of fwd+bwd alone (no activation, no scaling): the bound for this module."""
    offs = data["counts"].to(data["x"].device).cumsum(0, dtype=torch.int32)
    x, grad, w1, w2 = data["x"], data["grad"], ours.weight1.detach(), ours.weight2.detach()
    fc1 = torch._grouped_mm(x, w1, offs=offs)

    def gemms() -> None:
        h = torch._grouped_mm(x, w1, offs=offs)
        torch._grouped_mm(h, w2, offs=offs)
        d = torch._grouped_mm(grad, w2.transpose(-2, -1), offs=offs)
        torch._grouped_mm(fc1.t(), grad, offs=offs)
        torch._grouped_mm(d, w1.transpose(-2, -1), offs=offs)
        torch._grouped_mm(x.t(), d, offs=offs)

    seconds = timed(gemms, cuda, args.warmup, args.iters)
    routed = int(data["counts"].sum())
    flops = 6 * routed * (args.hidden * w1.shape[-1] + args.ffn * args.hidden)
    return {"fwd_bwd_ms": round(seconds * 1e3, 3), "fwd_bwd_tflops": round(flops / seconds / 1e12, 3)}


def step(module: Any, data: dict[str, torch.Tensor], backward: bool = True) -> tuple[torch.Tensor, ...]:
    x = data["x"].detach().requires_grad_(backward)
    probs = data["probs"].detach().requires_grad_(backward)
    out, _ = module(x, data["counts"], probs)
    if backward:
        out.backward(data["grad"])
        return out, x.grad, probs.grad
    return (out,)


def reference(seq: Any, data: dict[str, torch.Tensor], glu: bool) -> dict[str, torch.Tensor]:
    """fp32 per-expert loop with the same (bf16-valued) weights and inputs."""
    x = data["x"].float().requires_grad_()
    probs = data["probs"].detach().requires_grad_()
    w1 = [e.linear_fc1.weight.detach().float().requires_grad_() for e in seq.local_experts]
    w2 = [e.linear_fc2.weight.detach().float().requires_grad_() for e in seq.local_experts]
    outs, start = [], 0
    for e, n in enumerate(data["counts"].tolist()):
        h = x[start:start + n] @ w1[e].t()
        if glu:
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b
        else:
            h = F.gelu(h)
        outs.append((h * probs[start:start + n, None]) @ w2[e].t())
        start += n
    out = torch.cat(outs)
    out.backward(data["grad"].float())
    return {"output": out.detach(), "input grad": x.grad, "probs grad": probs.grad,
            "fc1 grad": torch.stack([w.grad.t() for w in w1]), "fc2 grad": torch.stack([w.grad.t() for w in w2])}


def check(args: argparse.Namespace, seq: Any, ours: Any, data: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    for module in (seq, ours):
        module.zero_grad(set_to_none=True)
    s_out, s_x, s_p = step(seq, data)
    o_out, o_x, o_p = step(ours, data)
    got = {
        "output": (s_out, o_out), "input grad": (s_x, o_x), "probs grad": (s_p, o_p),
        "fc1 grad": (torch.stack([e.linear_fc1.weight.grad.t() for e in seq.local_experts]), ours.weight1.grad),
        "fc2 grad": (torch.stack([e.linear_fc2.weight.grad.t() for e in seq.local_experts]), ours.weight2.grad),
    }
    ref = reference(seq, data, args.glu)
    rows = []
    for name, (a, b) in got.items():
        a, b, r = a.float(), b.float(), ref[name].float()
        scale = r.abs().max().item() or 1.0
        rows.append({"tensor": name, "max_abs_diff": (a - b).abs().max().item(),
                     "max_rel_diff": (a - b).abs().max().item() / scale,
                     "sequential_err_vs_fp32": (a - r).abs().max().item() / scale,
                     "grouped_err_vs_fp32": (b - r).abs().max().item() / scale})
    return rows


def timed(fn: Any, cuda: bool, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / iters
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - began) / iters


def speed(args: argparse.Namespace, module: Any, data: dict[str, torch.Tensor], cuda: bool) -> dict[str, Any]:
    routed = int(data["counts"].sum())
    fc1_out = args.ffn * (2 if args.glu else 1)
    fwd_flops = 2 * routed * (args.hidden * fc1_out + args.ffn * args.hidden)

    def train_step() -> None:
        module.zero_grad(set_to_none=True)
        step(module, data)

    def forward() -> None:
        with torch.no_grad():
            step(module, data, backward=False)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    fb = timed(train_step, cuda, args.warmup, args.iters)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    fw = timed(forward, cuda, args.warmup, args.iters)
    return {"fwd_bwd_ms": round(fb * 1e3, 3), "fwd_bwd_tflops": round(3 * fwd_flops / fb / 1e12, 3),
            "fwd_ms": round(fw * 1e3, 3), "fwd_tflops": round(fwd_flops / fw / 1e12, 3),
            "peak_above_inputs_gib": None if peak is None else round(peak, 3)}


def main() -> int:
    args = parse()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    import megatron.core

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
        "torch": torch.__version__, "megatron_core": getattr(megatron.core, "__version__", "?"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "shape": {k: getattr(args, k) for k in ("experts", "hidden", "ffn", "tokens", "topk", "glu", "skew")},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    setup(cuda)
    config = make_config(args, cuda)
    reason = experts_grouped.unsupported_reason(config)
    if reason:
        result["error"] = reason
        save()
        print(f"grouped experts cannot run: {reason}", file=sys.stderr)
        return 1
    torch.manual_seed(1234)
    seq, ours = build(config, args.experts)
    data = routing(args, device)
    result["tokens_per_expert"] = data["counts"].tolist()
    result["check"] = check(args, seq, ours, data)
    emptied = without_expert(data, 1)
    result["check_expert1_empty"] = check(args, seq, ours, emptied)
    save()
    print(f"{result['device']}, torch {result['torch']}, megatron-core {result['megatron_core']}, "
          f"tokens per expert {result['tokens_per_expert']}\n")
    print("| tensor | max abs diff | max rel diff | SequentialMLP err vs fp32 | grouped err vs fp32 |")
    print("|---|---|---|---|---|")
    for row in result["check"] + [dict(r, tensor=f"{r['tensor']} (expert 1 empty)")
                                  for r in result["check_expert1_empty"]]:
        print(f"| {row['tensor']} | {row['max_abs_diff']:.3g} | {row['max_rel_diff']:.3g} | "
              f"{row['sequential_err_vs_fp32']:.3g} | {row['grouped_err_vs_fp32']:.3g} |")
    result["speed"] = {}
    for name, module in (("SequentialMLP", seq), ("GroupedMMExperts", ours)):
        result["speed"][name] = speed(args, module, data, cuda)
        save()
    # The same module with its activation-and-scaling step compiled (torch.compile, one fused kernel each way).
    ours.elementwise = experts_grouped.Elementwise(args.glu, "compile")
    result["check_compiled"] = check(args, seq, ours, data)
    if ours.elementwise.mode == "compile":
        result["speed"]["GroupedMMExperts (compiled elementwise)"] = speed(args, ours, data, cuda)
    save()
    for row in result["check_compiled"]:
        print(f"| {row['tensor']} (compiled) | {row['max_abs_diff']:.3g} | {row['max_rel_diff']:.3g} | "
              f"{row['sequential_err_vs_fp32']:.3g} | {row['grouped_err_vs_fp32']:.3g} |")
    print("\n| experts module | fwd+bwd ms | fwd+bwd TFLOP/s | fwd ms | fwd TFLOP/s | peak GiB above inputs |")
    print("|---|---|---|---|---|---|")
    for name, row in result["speed"].items():
        print(f"| {name} | {row['fwd_bwd_ms']} | {row['fwd_bwd_tflops']} | {row['fwd_ms']} | {row['fwd_tflops']} | "
              f"{row['peak_above_inputs_gib']} |")
    if not args.glu:  # the bound: GEMMs alone (GLU's fc1 is twice as wide; gemm_only times the plain shape)
        result["gemm_only"] = gemm_only(args, ours, data, cuda)
        print(f"| grouped GEMMs alone | {result['gemm_only']['fwd_bwd_ms']} | {result['gemm_only']['fwd_bwd_tflops']}"
              " | | | |")
    s, g = result["speed"]["SequentialMLP"], result["speed"]["GroupedMMExperts"]
    result["speedup_fwd_bwd"] = round(s["fwd_bwd_ms"] / g["fwd_bwd_ms"], 2)
    c = result["speed"].get("GroupedMMExperts (compiled elementwise)")
    result["speedup_fwd_bwd_compiled"] = round(s["fwd_bwd_ms"] / c["fwd_bwd_ms"], 2) if c else None
    save()
    print(f"\nspeed-up fwd+bwd: {result['speedup_fwd_bwd']}x eager elementwise, "
          f"{result['speedup_fwd_bwd_compiled']}x compiled; JSON: {out}")
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
