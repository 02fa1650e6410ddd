"""Model architecture as the planner needs it: the shapes of every layer, nothing about weights.

Field names follow megatron-core's TransformerConfig where one exists, so a spec can be turned into a
megatron-core model (tests/unit/plan/test_megatron_params.py) and compared parameter for parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stepdeploy.errors import BadInput

AttentionKind = Literal["full", "sliding"]
FfnKind = Literal["dense", "moe"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Llama3RopeScaling(_Frozen):
    """Llama 3's RoPE frequency scaling (HF `rope_type: llama3`): long wavelengths divided by `factor`, short ones
    kept, a smooth blend between (transformers' `_compute_llama3_parameters`)."""

    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)


class RopeSpec(_Frozen):
    """Rotary position embedding of one kind of layer: base, the rotated fraction of each head (its first
    rotary_percent x kv_channels dims, half-rotation style), and an optional llama3 frequency scaling."""

    theta: float = Field(default=10000.0, gt=0)
    rotary_percent: float = Field(default=1.0, gt=0, le=1)
    llama3_scaling: Llama3RopeScaling | None = None


DEFAULT_ROPE = RopeSpec()  # megatron-core's GPTModel default: base 10000, every dim rotated, no scaling


class MoeSpec(_Frozen):
    """Routed experts (and optional shared experts) replacing the dense FFN on some layers."""

    num_experts: int = Field(gt=0)
    topk: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    shared_expert_ffn_hidden_size: int = Field(default=0, ge=0)
    first_dense_layers: int = Field(default=0, ge=0)
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    router_scaling_factor: float | None = None
    # megatron-core keeps the expert bias as a buffer, not a parameter: it is not counted.
    router_expert_bias: bool = False
    router_fp32: bool = False  # router logits in fp32 (HF need_fp32_gate; megatron moe_router_dtype fp32)
    # How the experts are kept balanced: an auxiliary loss (the proxies), or DeepSeek-V3's auxiliary-loss-free
    # scheme, the router's expert bias nudged by bias_update_rate x sign(mean load - load) after every step.
    load_balancing: Literal["aux_loss", "expert_bias"] = "aux_loss"
    aux_loss_coeff: float = Field(default=1e-2, ge=0)
    bias_update_rate: float = Field(default=1e-3, ge=0)

    @model_validator(mode="after")
    def _topk_fits(self) -> MoeSpec:
        if self.topk > self.num_experts:
            raise ValueError(f"topk {self.topk} exceeds num_experts {self.num_experts}")
        if self.load_balancing == "expert_bias" and not (self.router_expert_bias and self.score_function == "sigmoid"):
            raise ValueError("load_balancing expert_bias needs router_expert_bias and the sigmoid score function")
        return self


class TrainingDefaults(_Frozen):
    seq_length: int = Field(gt=0)
    global_batch_size: int = Field(gt=0)
    lr: float | None = Field(default=None, gt=0)  # peak learning rate; None: RenderOptions' DEFAULT_LR


class ModelSpec(_Frozen):
    name: str
    description: str
    sources: list[str] = Field(min_length=1)
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int = Field(gt=0)
    kv_channels: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    gated_linear_unit: bool = True
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    untie_embeddings_and_output_weights: bool = True
    # Step-3.5-Flash multiplies each head's output by sigmoid(g), g = Linear(hidden -> heads).
    attention_gate: Literal["none", "per_head"] = "none"
    sliding_window: int | None = None  # keys a query sees, itself included (HF's convention)
    sliding_num_attention_heads: int | None = None
    full_attention_every: int = Field(default=1, gt=0)
    rope: RopeSpec = DEFAULT_ROPE
    sliding_rope: RopeSpec | None = None  # sliding-window layers' own RoPE (None: `rope`)
    # RMSNorm weights stored zero-centred and applied as (1 + w) (Step-3.5-Flash, Gemma); the same function
    # as a plain weight w' = 1 + w, and the same training (norm weights take no weight decay).
    norm_zero_centered: bool = False
    # SwiGLU clamps by layer index (MTP layers follow the decoder: num_layers + k): Step-3.5-Flash computes
    # min(silu(gate), L) * clamp(up, -L, L). `swiglu_limits` for the routed experts, `_shared` for the shared
    # expert or the dense MLP of that layer.
    swiglu_limits: dict[int, float] = Field(default_factory=dict)
    swiglu_limits_shared: dict[int, float] = Field(default_factory=dict)
    moe: MoeSpec | None = None
    mtp_num_layers: int = Field(default=0, ge=0)
    mtp_attention: AttentionKind = "full"
    mtp_ffn: FfnKind = "dense"
    training: TrainingDefaults

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("num_attention_heads must be a multiple of num_query_groups")
        if self.sliding_window is None and self.full_attention_every != 1:
            raise ValueError("full_attention_every needs a sliding_window")
        if self.moe and self.moe.first_dense_layers >= self.num_layers:
            raise ValueError("moe.first_dense_layers leaves no MoE layer")
        last = self.num_layers + self.mtp_num_layers
        for name in ("swiglu_limits", "swiglu_limits_shared"):
            for index, limit in getattr(self, name).items():
                if not 0 <= index < last or limit <= 0:
                    raise ValueError(f"{name}: layer {index} (0-{last - 1}) with limit {limit} (> 0)")
                if not self.gated_linear_unit:
                    raise ValueError(f"{name} needs a gated (SwiGLU) MLP")
        if self.swiglu_limits and self.moe is None:
            raise ValueError("swiglu_limits clamps routed experts: the model has none")
        return self

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def layer(self, index: int) -> LayerShape:
        """Shape of decoder layer `index` (0-based)."""
        sliding = self.sliding_window is not None and index % self.full_attention_every != 0
        moe = self.moe is not None and index >= self.moe.first_dense_layers
        return self._shape(index, "sliding" if sliding else "full", "moe" if moe else "dense")

    def mtp_layer(self, k: int = 0) -> LayerShape:
        """The transformer layer inside MTP module `k` (Step-3.5-Flash's: sliding attention, a dense FFN)."""
        return self._shape(self.num_layers + k, self.mtp_attention, self.mtp_ffn if self.moe else "dense")

    def mtp_layers(self) -> list[LayerShape]:
        return [self.mtp_layer(k) for k in range(self.mtp_num_layers)]

    @property
    def uniform_attention(self) -> bool:
        """Every layer attends the same way stock megatron-core does: one head count, full causal attention,
        one RoPE, no output gate, plain norms (the engine's stock layer spec runs it)."""
        return (self.sliding_window is None and self.attention_gate == "none" and self.sliding_rope is None
                and self.rope == DEFAULT_ROPE and not self.norm_zero_centered
                and not self.swiglu_limits and not self.swiglu_limits_shared)

    def layers(self) -> list[LayerShape]:
        return [self.layer(i) for i in range(self.num_layers)]

    def head_counts(self) -> set[int]:
        return {shape.num_heads for shape in [*self.layers(), self.mtp_layer()]}

    def _shape(self, index: int, attention: AttentionKind, ffn: FfnKind) -> LayerShape:
        heads = self.num_attention_heads
        rope = self.rope
        if attention == "sliding":
            heads = self.sliding_num_attention_heads or self.num_attention_heads
            rope = self.sliding_rope or self.rope
        window = self.sliding_window if attention == "sliding" else None
        return LayerShape(attention=attention, ffn=ffn, num_heads=heads, window=window, index=index, rope=rope,
                          swiglu_limit=self.swiglu_limits.get(index) if ffn == "moe" else None,
                          shared_swiglu_limit=self.swiglu_limits_shared.get(index))


@dataclass(frozen=True)
class LayerShape:
    attention: AttentionKind
    ffn: FfnKind
    num_heads: int
    window: int | None
    index: int = 0  # 0-based; MTP layers follow the decoder's
    rope: RopeSpec = DEFAULT_ROPE
    swiglu_limit: float | None = None  # routed experts
    shared_swiglu_limit: float | None = None  # the shared expert, or the dense MLP


def parse_model(data: dict[str, Any], origin: str = "<model>") -> ModelSpec:
    """A ModelSpec from its fields; BadInput (one line) naming the first field that is wrong."""
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise BadInput(f"{origin}: {where}: {first['msg']}") from exc
