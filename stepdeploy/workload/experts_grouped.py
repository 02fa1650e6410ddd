"""MoE experts on `torch._grouped_mm`: a drop-in for megatron-core's SequentialMLP without TransformerEngine.

Stock megatron-core without TE runs a layer's local experts one after the other (SequentialMLP: a Python loop of
small GEMMs); its GroupedMLP needs the `grouped_gemm` package. This module holds the local experts' weights
stacked ([experts, in, out], fc1 and fc2) and runs each projection as one grouped GEMM over the permuted tokens
(torch._grouped_mm, offsets = cumulative tokens per expert). Interface as SequentialMLP in megatron-core 0.16
and 0.19: built as experts(num_local_experts, config, pg_collection=..., [name=...]) by MoELayer, forward
(permuted_local_hidden_states, tokens_per_expert, permuted_probs) -> (output, None), with the router's probs
applied after the activation as megatron's MLP does (or on the input under moe_apply_probs_on_input).
The activation-and-scaling step runs eager or, with ELEMENTWISE = "compile" (the engine's choice), as one
torch.compile'd kernel each way: on the H200 (proxy-0.7b-moe layer, 16384 routed rows) fwd+bwd 5.9 ms against
SequentialMLP's 7.8 ms, the grouped GEMMs alone taking 5.3 ms (docs/benchmarks.md, bench/gpu_experts.py).

Scope: expert tensor parallel size 1, no bias in expert linears, no FP8/FP4 (the engine keeps SequentialMLP
otherwise). Checkpoints (dist-checkpointing) hold each weight as one tensor sharded along the expert axis; they
are not interchangeable with SequentialMLP's per-expert layout. Standard library + torch + megatron-core only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ELEMENTWISE = "eager"  # or "compile": torch.compile the activation-and-scaling step (set before building)
MIN_TORCH_ALIGN = 8  # CUDA grouped GEMM: bf16 rows must be 16-byte aligned (hidden and ffn multiples of 8)


def available() -> bool:
    return hasattr(torch, "_grouped_mm")


def unsupported_reason(config: Any) -> str | None:
    """Why this module cannot stand in for SequentialMLP under `config` (None: it can)."""
    if not available():
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if config.expert_tensor_parallel_size not in (None, 1):
        return f"expert tensor parallel size {config.expert_tensor_parallel_size} (grouped experts support 1)"
    if config.add_bias_linear:
        return "expert linears with bias"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return "FP8/FP4 experts"
    if getattr(config, "moe_latent_size", None):
        return "MoE latent projection"
    if config.gated_linear_unit and config.activation_func is not F.silu:
        return f"gated activation {getattr(config.activation_func, '__name__', config.activation_func)} (SwiGLU only)"
    if not config.gated_linear_unit and config.activation_func is not F.gelu:
        return f"activation {getattr(config.activation_func, '__name__', config.activation_func)} (GELU only)"
    if getattr(config, "activation_func_clamp_value", None) is not None or getattr(config, "glu_linear_offset", 0.0):
        return "clamped GLU or GLU linear offset"
    ffn = config.moe_ffn_hidden_size
    if config.hidden_size % MIN_TORCH_ALIGN or ffn % MIN_TORCH_ALIGN:
        return f"hidden {config.hidden_size} / expert ffn {ffn} not multiples of {MIN_TORCH_ALIGN}"
    return None


_SQRT1_2, _INV_SQRT_2PI = 0.7071067811865476, 0.3989422804014327


def _gelu_scale(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """GELU, then the router's probs, rounded as megatron's eager MLP rounds (bf16 activation, fp32 product)."""
    return (F.gelu(fc1) * probs.unsqueeze(-1)).to(fc1.dtype)


def _gelu_scale_backward(fc1: torch.Tensor, probs: torch.Tensor,
                         grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of _gelu_scale (to fc1 and probs) from the gradient of its output, and the output again (fc2's
    input, for fc2's weight gradient): one pass over [tokens, ffn] once compiled."""
    x = fc1.float()
    cdf = 0.5 * (1.0 + torch.erf(x * _SQRT1_2))
    act = (x * cdf).to(fc1.dtype).float()
    p = probs.unsqueeze(-1)
    g = grad.float()
    grad_probs = (g * act).sum(-1)
    grad_act = (g * p).to(fc1.dtype).float()
    grad_fc1 = (grad_act * (cdf + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI)).to(fc1.dtype)
    return grad_fc1, grad_probs, (act * p).to(fc1.dtype)


def _swiglu_scale(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    a, b = torch.chunk(fc1, 2, dim=-1)
    return ((F.silu(a) * b) * probs.unsqueeze(-1)).to(fc1.dtype)


def _swiglu_scale_backward(fc1: torch.Tensor, probs: torch.Tensor,
                           grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b = torch.chunk(fc1, 2, dim=-1)
    af, bf = a.float(), b.float()
    sig = torch.sigmoid(af)
    silu = (af * sig).to(fc1.dtype).float()
    act = (silu * bf).to(fc1.dtype).float()
    p = probs.unsqueeze(-1)
    g = grad.float()
    grad_probs = (g * act).sum(-1)
    grad_act = (g * p).to(fc1.dtype).float()
    grad_a = (grad_act * bf).to(fc1.dtype).float() * (sig * (1.0 + af * (1.0 - sig)))
    grad_b = grad_act * silu
    return torch.cat((grad_a, grad_b), -1).to(fc1.dtype), grad_probs, (act * p).to(fc1.dtype)


def _swiglu_clamped_scale(fc1: torch.Tensor, probs: torch.Tensor, limit: float) -> torch.Tensor:
    """Step-3.5-Flash's clamped SwiGLU, min(silu(a), limit) * clamp(b, -limit, limit), then the router's probs."""
    a, b = torch.chunk(fc1, 2, dim=-1)
    act = F.silu(a).clamp(max=limit) * b.clamp(-limit, limit)
    return (act * probs.unsqueeze(-1)).to(fc1.dtype)


def _swiglu_clamped_scale_backward(fc1: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor,
                                   limit: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of _swiglu_clamped_scale (a clamp passes the gradient where its input lies inside, bounds
    included, as torch.clamp's backward), and the output again for fc2's weight gradient."""
    a, b = torch.chunk(fc1, 2, dim=-1)
    af, bf = a.float(), b.float()
    sig = torch.sigmoid(af)
    silu = af * sig
    silu_c, b_c = silu.clamp(max=limit), bf.clamp(-limit, limit)
    act = silu_c * b_c
    p = probs.unsqueeze(-1)
    g = grad.float()
    grad_probs = (g * act).sum(-1)
    grad_act = g * p
    grad_a = grad_act * b_c * (silu <= limit) * (sig * (1.0 + af * (1.0 - sig)))
    grad_b = grad_act * silu_c * ((bf >= -limit) & (bf <= limit))
    return torch.cat((grad_a, grad_b), -1).to(fc1.dtype), grad_probs, (act * p).to(fc1.dtype)


class Elementwise:
    """The activation-and-scaling step and its backward, eager or compiled by torch.compile (one fused kernel
    each way instead of ~8, and no fp32 [tokens, ffn] temporaries). `compile` falls back to eager, once, with a
    log line, where torch.compile cannot run. `limit`: a clamped SwiGLU (Step-3.5-Flash's swiglu_limits)."""

    def __init__(self, gated: bool, mode: str, limit: float | None = None) -> None:
        self.forward_fn, self.backward_fn = ((_swiglu_scale, _swiglu_scale_backward) if gated
                                             else (_gelu_scale, _gelu_scale_backward))
        if limit is not None:
            if not gated:
                raise ValueError("a SwiGLU limit needs a gated MLP")

            def forward_fn(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
                return _swiglu_clamped_scale(fc1, probs, limit)

            def backward_fn(fc1: torch.Tensor, probs: torch.Tensor,
                            grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return _swiglu_clamped_scale_backward(fc1, probs, grad, limit)

            self.forward_fn, self.backward_fn = forward_fn, backward_fn
        self.mode = mode
        self._compiled: tuple[Any, Any] | None = None
        if mode == "compile":
            self._compiled = (torch.compile(self.forward_fn, dynamic=True),
                              torch.compile(self.backward_fn, dynamic=True))

    def _run(self, which: int, *args: torch.Tensor) -> Any:
        assert self._compiled is not None
        try:
            return self._compiled[which](*args)
        except Exception as exc:  # no compiler/triton on this node: eager from now on
            print(f"experts_grouped: torch.compile failed ({type(exc).__name__}: {str(exc)[:200]}); eager "
                  "elementwise", flush=True)
            self._compiled, self.mode = None, "eager"
        return self.forward(*args) if which == 0 else self.backward(*args)

    def forward(self, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return self.forward_fn(fc1, probs) if self._compiled is None else self._run(0, fc1, probs)

    def backward(self, fc1: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._compiled is not None:
            return self._run(1, fc1, probs, grad)
        # eager: recompute under autograd and differentiate (torch's fused activation backward kernels; the
        # hand-written backward_fn is for the compiler, and slower than this when run op by op)
        with torch.enable_grad():
            fc1 = fc1.detach().requires_grad_()
            probs = probs.detach().requires_grad_()
            scaled = self.forward_fn(fc1, probs)
        grad_fc1, grad_probs = torch.autograd.grad(scaled, (fc1, probs), grad)
        return grad_fc1, grad_probs, scaled.detach()


class _GroupedExperts(torch.autograd.Function):
    """fc1 -> activation and router-prob scaling -> fc2, each projection one grouped GEMM over the experts.

    Saves only the input and fc1's output for backward: the activation and scaling are recomputed there (in the
    same pass that differentiates them), so a layer keeps 2 activations of [tokens, ffn] fewer than SequentialMLP
    (which saves fc1's output, the activation's and the scaled one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, probs: torch.Tensor,
                offs: torch.Tensor, elementwise: Elementwise) -> torch.Tensor:
        fc1 = torch._grouped_mm(x, w1, offs=offs)
        out = torch._grouped_mm(elementwise.forward(fc1, probs), w2, offs=offs)
        ctx.save_for_backward(x, w1, w2, probs, offs, fc1)
        ctx.elementwise = elementwise
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w1, w2, probs, offs, fc1 = ctx.saved_tensors
        grad = grad.contiguous()
        grad_scaled = torch._grouped_mm(grad, w2.transpose(-2, -1), offs=offs)
        grad_fc1, grad_probs, scaled = ctx.elementwise.backward(fc1, probs, grad_scaled)
        grad_w2 = torch._grouped_mm(scaled.t(), grad, offs=offs)
        grad_x = torch._grouped_mm(grad_fc1, w1.transpose(-2, -1), offs=offs)
        grad_w1 = torch._grouped_mm(x.t(), grad_fc1, offs=offs)
        return grad_x, grad_w1, grad_w2, grad_probs.to(probs.dtype), None, None


def grouped_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, probs: torch.Tensor, offs: torch.Tensor,
                elementwise: Elementwise) -> torch.Tensor:
    """Rows of x in expert order (offs: int32 end row of each expert) through each expert's fc1 [in, out],
    the activation and scaling by probs, fc2 [in, out]."""
    return _GroupedExperts.apply(x, w1, w2, probs, offs, elementwise)


def _megatron() -> Any:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule, set_tensor_model_parallel_attributes, get_cuda_rng_tracker, \
        get_expert_parallel_rng_tracker_name


def _build_class() -> type:  # long: the class body, built late (its base is megatron's); each method is short
    MegatronModule, set_tp_attributes, get_cuda_rng_tracker, expert_rng_name = _megatron()

    class GroupedMMExperts(MegatronModule):
        """The local experts of one MoE layer as two stacked weights run by torch._grouped_mm."""

        swiglu_limit: float | None = None  # a subclass per clamped layer sets it (with_swiglu_limit)

        def __init__(self, num_local_experts: int, config: Any, submodules: Any = None,
                     pg_collection: Any = None, name: str | None = None, **_ignored: Any) -> None:
            super().__init__(config=config)
            reason = unsupported_reason(config)
            if reason:
                raise ValueError(f"GroupedMMExperts cannot run this layer: {reason}")
            if pg_collection is None:
                from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

                pg_collection = get_default_pg_collection()
            self.num_local_experts = num_local_experts
            self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
            hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
            fc1_out = ffn * 2 if config.gated_linear_unit else ffn
            device = None if config.use_cpu_initialization else torch.cuda.current_device()
            self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, fc1_out, device=device,
                                                          dtype=config.params_dtype))
            self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, ffn, hidden, device=device,
                                                          dtype=config.params_dtype))
            if config.perform_initialization:
                self._initialize(config)
            self.elementwise = Elementwise(config.gated_linear_unit, ELEMENTWISE, self.swiglu_limit)
            # As megatron's expert linears: tensor-parallel attributes (ETP 1: whole), and expert-parallel
            # parameters (allreduce False) go to the expert data-parallel group in DDP and the optimizer.
            tp = config.tensor_model_parallel_size
            expert_groups = config.expert_model_parallel_size > 1 or (config.expert_tensor_parallel_size or tp) != tp
            for weight, dim in ((self.weight1, 2), (self.weight2, 1)):
                set_tp_attributes(weight, True, dim, 1)
                weight.allreduce = not expert_groups

        @torch.no_grad()
        def _initialize(self, config: Any) -> None:
            """Per expert, SequentialMLP's order and shapes: fc1 [out, in] with init_method, then fc2 [out, in]
            with output_layer_init_method (CPU: a float32 master as megatron's CPU path; GPU: under the
            expert-parallel RNG tracker, so EP ranks draw different experts)."""
            specs = ((self.weight1, config.init_method), (self.weight2, config.output_layer_init_method))
            for expert in range(self.num_local_experts):
                for weight, init in specs:
                    target = weight[expert]  # [in, out]
                    if config.use_cpu_initialization:
                        master = torch.empty(target.shape[1], target.shape[0], dtype=torch.float)
                        init(master)
                        target.copy_(master.to(config.params_dtype).t())
                    else:
                        master = torch.empty(target.shape[1], target.shape[0], device=target.device,
                                             dtype=config.params_dtype)
                        with get_cuda_rng_tracker().fork(expert_rng_name()):
                            init(master)
                        target.copy_(master.t())

        def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                    permuted_probs: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
            if kwargs.get("output_buffer") is not None or kwargs.get("grad_input_buffer") is not None:
                raise ValueError("GroupedMMExperts does not write into zero-copy dispatcher buffers")
            x, probs = permuted_local_hidden_states, permuted_probs
            if self.config.moe_apply_probs_on_input:
                if self.config.moe_router_topk != 1:
                    raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1")
                x = (probs.unsqueeze(-1) * x).to(x.dtype)
                probs = torch.ones_like(probs)
            if x.shape[0] == 0:
                # No token for the local experts: still give both weights a (zero) gradient, as GroupedMLP does,
                # so that DDP's gradient hooks fire on every rank.
                return self.elementwise.forward_fn(x @ self.weight1[0], probs) @ self.weight2[0], None
            counts = tokens_per_expert.to(device=x.device, dtype=torch.int32, non_blocking=True)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            return grouped_mlp(x, self.weight1, self.weight2, probs, offs, self.elementwise), None

        def backward_dw(self) -> None:
            """Weight gradients are computed in backward (no delayed wgrad), as SequentialMLP's local linears."""

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                               metadata: dict | None = None) -> dict[str, Any]:
            """Each weight as one ShardedTensor of [global experts, in, out]: this rank's experts at offset
            ep_rank * local experts; replicas (replica_id != 0) are the other ranks of the expert data-parallel
            group. The parameter itself is the data, so the distributed optimizer can map its state onto it."""
            from megatron.core.dist_checkpointing import ShardedTensor

            ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
            replica_id = (0, self.tp_group.rank(), self.dp_group.rank())
            axis = len(sharded_offsets)
            state = {}
            for name in ("weight1", "weight2"):
                param = getattr(self, name)
                state[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                    f"{prefix}{name}", param, *sharded_offsets, (axis, ep_rank, ep_size),
                    replica_id=replica_id, prepend_axis_num=axis)
            return state

    return GroupedMMExperts


_CLASS: type | None = None


def experts_class() -> type:
    """The module class (built on first use: importing this file needs no megatron-core)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _build_class()
    return _CLASS


def with_swiglu_limit(limit: float | None) -> type:
    """The experts class, or a subclass that clamps its SwiGLU at `limit` (a class, not a spec with params: both
    megatron-core 0.16, which builds experts from a spec, and 0.19, which calls the builder, accept a class)."""
    cls = experts_class()
    if limit is None:
        return cls
    return type(f"GroupedMMExpertsClamped{limit:g}", (cls,), {"swiglu_limit": float(limit)})


def use_in_block_spec(block: Any, config: Any) -> int:
    """Replace the experts of every MoE layer in a decoder block spec (0.16: ModuleSpec, 0.19: partial) with
    GroupedMMExperts; returns how many layers changed."""
    cls = experts_class()
    changed = 0
    for spec in block.layer_specs:
        mlp = spec.submodules.mlp
        subs = getattr(mlp, "submodules", None)
        if subs is None and hasattr(mlp, "keywords"):  # functools.partial(MoELayer, submodules=...)
            subs = mlp.keywords.get("submodules")
        if subs is not None and hasattr(subs, "experts"):
            subs.experts = cls
            changed += 1
    return changed
