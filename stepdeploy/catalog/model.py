"""Model architecture as the planner needs it: the shapes of every layer, nothing about weights.

Field names follow megatron-core's TransformerConfig where one exists, so a spec can be turned into a
megatron-core model (tests/unit/plan/test_megatron_params.py) and compared parameter for parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AttentionKind = Literal["full", "sliding"]
FfnKind = Literal["dense", "moe"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


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

    @model_validator(mode="after")
    def _topk_fits(self) -> MoeSpec:
        if self.topk > self.num_experts:
            raise ValueError(f"topk {self.topk} exceeds num_experts {self.num_experts}")
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
    sliding_window: int | None = None
    sliding_num_attention_heads: int | None = None
    full_attention_every: int = Field(default=1, gt=0)
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
        return self

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def layer(self, index: int) -> LayerShape:
        """Shape of decoder layer `index` (0-based)."""
        sliding = self.sliding_window is not None and index % self.full_attention_every != 0
        moe = self.moe is not None and index >= self.moe.first_dense_layers
        return self._shape("sliding" if sliding else "full", "moe" if moe else "dense")

    def mtp_layer(self) -> LayerShape:
        """The transformer layer inside each MTP module (Step-3.5-Flash's has a dense FFN)."""
        return self._shape(self.mtp_attention, self.mtp_ffn if self.moe else "dense")

    def layers(self) -> list[LayerShape]:
        return [self.layer(i) for i in range(self.num_layers)]

    def head_counts(self) -> set[int]:
        return {shape.num_heads for shape in [*self.layers(), self.mtp_layer()]}

    def _shape(self, attention: AttentionKind, ffn: FfnKind) -> LayerShape:
        heads = self.num_attention_heads
        if attention == "sliding":
            heads = self.sliding_num_attention_heads or self.num_attention_heads
        window = self.sliding_window if attention == "sliding" else None
        return LayerShape(attention=attention, ffn=ffn, num_heads=heads, window=window)


@dataclass(frozen=True)
class LayerShape:
    attention: AttentionKind
    ffn: FfnKind
    num_heads: int
    window: int | None
