"""megatron-core layer specs for models whose layers are not all alike: Step-3.5-Flash.

Every layer gets its own head count, attention (full causal or a sliding window), RoPE (base, rotated fraction,
llama3 frequency scaling), a per-head output gate, zero-centred RMSNorms and clamped SwiGLUs, as workload.json's
"layers" and "mtp_layers" say (render/workload.py writes them from the catalog). Each layer starts from
megatron-core's own local layer spec (get_gpt_layer_local_spec: TransformerLayer, SelfAttention, MLP or MoELayer
with its TopKRouter and SharedExpertMLP, the MTP block of get_gpt_mtp_block_spec) and swaps only what stock
megatron-core lacks:
- SelfAttention -> a subclass per layer kind holding a copy of the config with that layer's head count, a
  ColumnParallelLinear hidden -> heads for the gate (g_proj: one sigmoid per head, not megatron's element-wise
  attention_output_gate), and its own rotary table (megatron-core's GPTModel has one RoPE for all layers);
- the core attention -> attention.py (SDPA / flash-attn for full layers, FlexAttention for windows);
- the norms -> ZeroCenteredRMSNorm ((1 + w) in fp32, as modeling_step3p5.py; megatron's local norm refuses
  zero-centred weights);
- the MLP, shared expert and grouped experts of clamped layers -> subclasses computing
  min(silu(gate), L) * clamp(up, -L, L) (megatron's activation_func_clamp_value clamps before the SiLU).

Per-layer settings are class attributes of a subclass made for them: megatron-core 0.16 builds submodules from
ModuleSpecs and 0.19 calls builders directly, and both accept a class. Standard library + torch + megatron-core.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import attention
import experts_grouped
import torch
import torch.nn.functional as F
from compiled import CompiledOrEager

_CACHE: dict[Any, type] = {}


# --- RoPE ---------------------------------------------------------------------------------------------------

def rope_inv_freq(rope: dict[str, Any], kv_channels: int) -> torch.Tensor:
    """Inverse frequencies (fp32) of the rotated part of a head: its first rotary_percent x kv_channels dims,
    frequencies theta^(-2i/dim) over that rotary dim, then llama3 scaling where the layer has it."""
    dim = int(kv_channels * rope["rotary_percent"])
    inv_freq = 1.0 / (rope["theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # fp32, as HF
    scaling = rope.get("llama3_scaling")
    return llama3_scaled(inv_freq, scaling) if scaling else inv_freq


def llama3_scaled(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3's frequency scaling: wavelengths beyond original / low_freq_factor are stretched by `factor`,
    those under original / high_freq_factor kept, and the band between blended linearly in original/wavelength."""
    wavelength = 2 * math.pi / inv_freq
    ratio = s["original_max_position_embeddings"] / wavelength  # periods that fit the original context
    blend = ((ratio - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])).clamp(0.0, 1.0)
    return inv_freq / s["factor"] * (1 - blend) + inv_freq * blend


def rotary_table(rope: dict[str, Any], kv_channels: int, seq: int, device: torch.device) -> torch.Tensor:
    """megatron's rotary_pos_emb layout, [seq, 1, 1, rotary dim] angles (cat(freqs, freqs): half rotation)."""
    inv_freq = rope_inv_freq(rope, kv_channels).to(device)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


# --- norms and activations ----------------------------------------------------------------------------------

def _zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


_COMPILED_NORM: list[Any] = []


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the weight applied as (1 + w), in fp32: one fused kernel on the GPU (torch.compile)."""
    if not x.is_cuda:
        return _zero_centered_rms_norm(x, weight, eps)
    if not _COMPILED_NORM:
        _COMPILED_NORM.append(torch.compile(_zero_centered_rms_norm, dynamic=False))
    return _COMPILED_NORM[0](x, weight, eps)


def mark_sequence_parallel(module: torch.nn.Module, config: Any) -> torch.nn.Module:
    """Mark a norm's parameters as megatron marks its own norms' (FusedLayerNorm, TENorm): under sequence
    parallelism each TP rank normalises its own slice of the sequence, so the weight's gradient is a partial sum
    that finalize_model_grads all-reduces over TP (its `sequence_parallel` attribute is what it looks for)."""
    for param in module.parameters():
        param.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    return module


class LocalNorm:
    """megatron-core's local norm (torch LayerNorm / RMSNorm, as its WrappedTorchNorm builds) that also runs under
    sequence parallelism: WrappedTorchNorm refuses it ("sequence parallel not supported by torch LayerNorm") only
    because it does not mark its parameters for the gradients' all-reduce over TP; this one does. A norm is
    per-token, so a sequence slice normalises as the whole sequence would."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_ignored: Any) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"LocalNorm: normalization {config.normalization!r} (LayerNorm or RMSNorm)")
        return mark_sequence_parallel(norm, config)


def sequence_parallel_norms(spec: Any) -> Any:
    """`spec` (a layer, block or MTP spec of megatron-core's local layers, changed in place) with LocalNorm wherever
    it builds megatron's WrappedTorchNorm. -> spec"""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    seen: set[int] = set()

    def visit(node: Any) -> Any:
        if node is WrappedTorchNorm:
            return LocalNorm
        if id(node) in seen or node is None or isinstance(node, (type, str, int, float, bool)):
            return node
        seen.add(id(node))
        if isinstance(node, list):
            node[:] = [visit(item) for item in node]
        elif isinstance(node, functools.partial):
            node.keywords.update({k: visit(v) for k, v in node.keywords.items()})
        elif isinstance(node, ModuleSpec) or hasattr(node, "__dataclass_fields__"):
            for name in getattr(node, "__dataclass_fields__", {}):
                old = getattr(node, name)
                new = visit(old)
                if new is not old:
                    setattr(node, name, new)
        return node

    return visit(spec)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """megatron's norm interface (config, hidden_size, eps); the weight starts at zero (the identity). Runs under
    sequence parallelism as LocalNorm does (its weight marked for the gradients' all-reduce over TP)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_ignored: Any) -> None:
        super().__init__()
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=config.params_dtype))
        self.eps = eps
        mark_sequence_parallel(self, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, self.weight, self.eps)


def clamped_swiglu(x: torch.Tensor, limit: float) -> torch.Tensor:
    """Step-3.5-Flash's SwiGLU with a limit: min(silu(gate), L) * clamp(up, -L, L) on [gate | up] halves."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)


_COMPILED_SWIGLU = CompiledOrEager(clamped_swiglu, "layers.py clamped SwiGLU")


def fused_clamped_swiglu(x: torch.Tensor, limit: float) -> torch.Tensor:
    """`clamped_swiglu` as one kernel each way (torch.compile) on a GPU tensor; eager elsewhere. What a clamped MLP
    runs when TransformerConfig.bias_activation_fusion is set, as megatron's own MLP then runs its fused SwiGLU."""
    if x.device.type != "cuda":
        return clamped_swiglu(x, limit)
    return _COMPILED_SWIGLU(x, limit)


def _clamped_mlp_forward(module: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, Any]:
    fc1, bias = module.linear_fc1(hidden_states)
    if bias is not None:
        fc1 = fc1 + bias
    activation = fused_clamped_swiglu if module.config.bias_activation_fusion else clamped_swiglu
    return module.linear_fc2(activation(fc1, module.swiglu_limit))


def mlp_class(limit: float) -> type:
    """megatron's MLP with a clamped SwiGLU (a dense layer's, or Step's dense MTP layers')."""
    key = ("mlp", limit)
    if key not in _CACHE:
        from megatron.core.transformer.mlp import MLP

        def forward(self: Any, hidden_states: torch.Tensor, *_args: Any, **_kwargs: Any) -> Any:
            return _clamped_mlp_forward(self, hidden_states)

        _CACHE[key] = type(f"ClampedSwiGLUMLP{limit:g}", (MLP,), {"swiglu_limit": limit, "forward": forward})
    return _CACHE[key]


def shared_expert_class(limit: float) -> type:
    """megatron's SharedExpertMLP (no gate: Step adds the shared expert ungated) with a clamped SwiGLU."""
    key = ("shared", limit)
    if key not in _CACHE:
        from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

        def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
            if self.use_shared_expert_gate:
                raise ValueError("a clamped shared expert has no gate")
            output, _ = _clamped_mlp_forward(self, hidden_states)
            return output

        _CACHE[key] = type(f"ClampedSharedExpertMLP{limit:g}", (SharedExpertMLP,),
                           {"swiglu_limit": limit, "forward": forward})
    return _CACHE[key]


# --- attention ----------------------------------------------------------------------------------------------

def attention_class(layer: dict[str, Any], gated: bool) -> type:
    """A SelfAttention subclass for one kind of layer: its head count, its own RoPE and, when `gated`, a
    per-head sigmoid gate on the attention output (computed from the same normed input as q, k, v)."""
    rope = layer["rope"]
    key = ("attention", layer["num_heads"], repr(sorted(rope.items())), gated)
    if key in _CACHE:
        return _CACHE[key]
    from megatron.core.transformer.attention import SelfAttention

    class LayerAttention(SelfAttention):
        heads = layer["num_heads"]
        rope_settings = rope
        head_gate = gated

        def __init__(self, config: Any, submodules: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
            config = copy.copy(config)  # this layer's head count; everything else shared
            config.num_attention_heads = self.heads
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            if self.head_gate:
                self.linear_gate = submodules.linear_qkv(
                    config.hidden_size, self.heads, config=config, init_method=config.init_method,
                    gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                    tp_comm_buffer_name="gate", tp_group=self.pg_collection.tp)
            self._rotary: dict[tuple[int, str], torch.Tensor] = {}

        def rotary(self, seq: int, device: torch.device) -> torch.Tensor:
            key = (seq, str(device))
            if key not in self._rotary:
                self._rotary[key] = rotary_table(self.rope_settings, self.config.kv_channels, seq, device)
            return self._rotary[key]

        def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, *args: Any,
                    **kwargs: Any) -> Any:
            if args:
                raise TypeError("LayerAttention takes its optional arguments by keyword")
            # under sequence parallelism the layer's input is this rank's slice of the sequence; q, k and v
            # (after linear_qkv's all-gather) cover the whole of it
            seq = hidden_states.shape[0] * (self.config.tensor_model_parallel_size
                                            if self.config.sequence_parallel else 1)
            kwargs["rotary_pos_emb"] = self.rotary(seq, hidden_states.device)
            if self.head_gate:
                # the gate's logits reach the core attention in its one per-call tensor (attention.py)
                kwargs["attention_bias"], _ = self.linear_gate(hidden_states)
            return super().forward(hidden_states, attention_mask, **kwargs)

    LayerAttention.__name__ = LayerAttention.__qualname__ = f"LayerAttention{layer['num_heads']}"
    _CACHE[key] = LayerAttention
    return LayerAttention


# --- specs --------------------------------------------------------------------------------------------------

def _with_class(builder: Any, cls: type) -> Any:
    """A submodule builder (0.16: a ModuleSpec; 0.19: functools.partial of a class or its classmethod) that
    builds `cls` instead, with the same submodules and parameters."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(builder, ModuleSpec):
        builder = copy.copy(builder)
        builder.module = cls
        return builder
    if isinstance(builder, functools.partial):
        owner = getattr(builder.func, "__self__", None)
        func = getattr(cls, builder.func.__name__) if isinstance(owner, type) else cls
        return functools.partial(func, *builder.args, **builder.keywords)
    raise TypeError(f"cannot rebuild {builder!r} as {cls.__name__}")


def _shared_experts_builder(builder: Any, cls: type) -> Any:
    """0.19 builds shared experts with a function (partial(_build_shared_experts, submodules=...)); 0.16 from a
    ModuleSpec of SharedExpertMLP."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(builder, ModuleSpec):
        return _with_class(builder, cls)

    def build(*, config: Any, pg_collection: Any, gate: bool, submodules: Any, name: str | None = None) -> Any:
        return cls(config=config, submodules=submodules, gate=gate, pg_collection=pg_collection)

    return functools.partial(build, **builder.keywords)


def _moe_submodules(mlp: Any) -> Any:
    subs = getattr(mlp, "submodules", None)
    if subs is None and isinstance(mlp, functools.partial):
        subs = mlp.keywords.get("submodules")
    if subs is None or not hasattr(subs, "experts"):
        raise TypeError(f"not an MoE layer spec: {mlp!r}")
    return subs


def layer_spec(layer: dict[str, Any], model: dict[str, Any], experts: str) -> Any:
    """The ModuleSpec of one decoder (or MTP) layer described by workload.json's `layer`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    moe = layer["ffn"] == "moe"
    spec = sequence_parallel_norms(copy.deepcopy(get_gpt_layer_local_spec(
        model["moe"]["num_experts"] if moe else None, moe_grouped_gemm=False,
        qk_layernorm=model["qk_layernorm"], normalization=model["normalization"])))
    subs = spec.submodules
    attn = subs.self_attention
    attn.module = attention_class(layer, model["attention_gate"] == "per_head")
    attn.submodules.core_attention = attention.core_attention_class(layer["window"])
    if model["norm_zero_centered"]:
        subs.input_layernorm = subs.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if model["qk_layernorm"]:
            attn.submodules.q_layernorm = attn.submodules.k_layernorm = ZeroCenteredRMSNorm
    limit, shared_limit = layer["swiglu_limit"], layer["shared_swiglu_limit"]
    if not moe:
        if shared_limit:
            subs.mlp = _with_class(subs.mlp, mlp_class(shared_limit))
        return spec
    moe_subs = _moe_submodules(subs.mlp)
    if experts.startswith("grouped_mm"):
        moe_subs.experts = experts_grouped.with_swiglu_limit(limit)
    elif limit:
        raise ValueError(f"layer {layer['index']}: a SwiGLU limit needs the grouped experts (not {experts})")
    if shared_limit:
        moe_subs.shared_experts = _shared_experts_builder(moe_subs.shared_experts, shared_expert_class(shared_limit))
    return spec


def final_norm_class(model: dict[str, Any], first_layer: Any) -> Any:
    return ZeroCenteredRMSNorm if model["norm_zero_centered"] else first_layer.submodules.input_layernorm


def block_spec(cfg: dict[str, Any], config: Any, experts: str, vp_stage: int | None = None) -> Any:
    """The decoder block of this pipeline stage (megatron's offset and layer count for the stage)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    model = cfg["model"]
    specs = [layer_spec(layer, model, experts) for layer in model["layers"]]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local = specs[offset:offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=final_norm_class(model, specs[0]))


def mtp_block_spec(cfg: dict[str, Any], config: Any, experts: str, vp_stage: int | None = None) -> Any:
    """megatron-core's MTP block (enorm, hnorm, eh_proj, a transformer layer, a final norm per module; the output
    layer shared with the model), each module's layer as workload.json's mtp_layers say; None off the stage."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    model = cfg["model"]
    layers = model["mtp_layers"]
    if not layers:
        return None
    block = get_gpt_mtp_block_spec(config, layer_spec(layers[0], model, experts), use_transformer_engine=False,
                                   vp_stage=vp_stage)
    if block is None:
        return None
    block.layer_specs = [copy.deepcopy(spec) for spec in block.layer_specs]
    sequence_parallel_norms(block)
    for spec, layer in zip(block.layer_specs, layers, strict=True):
        subs = spec.submodules
        inner = "mtp_model_layer" if hasattr(subs, "mtp_model_layer") else "transformer_layer"  # 0.19 / 0.16
        setattr(subs, inner, layer_spec(layer, model, experts))
        if model["norm_zero_centered"]:
            subs.enorm = subs.hnorm = subs.layer_norm = ZeroCenteredRMSNorm
    return block
