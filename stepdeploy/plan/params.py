"""Exact parameter counts of a ModelSpec, per layer, the way megatron-core builds the model.

Conventions (megatron-core GPTModel, local layer spec): linear_qkv is one [h, q + 2kv] matrix;
RMSNorm has a weight, LayerNorm a weight and a bias; the router is an [E, h] matrix (plus a bias only
under add_bias_linear); the expert bias of sigmoid routers is a buffer (not counted); an MTP module
has enorm, hnorm, eh_proj [2h -> h, no bias], one transformer layer and its own final norm, and
shares the output layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.catalog.model import LayerShape, ModelSpec


@dataclass(frozen=True)
class LayerParams:
    """One decoder (or MTP) layer. `expert` is ONE routed expert; there are `num_experts` of them."""

    label: str
    shape: LayerShape
    attention: int
    norms: int
    dense_mlp: int = 0
    router: int = 0
    expert: int = 0
    num_experts: int = 0
    topk: int = 0
    shared_expert: int = 0
    mtp_extra: int = 0

    @property
    def experts_total(self) -> int:
        return self.expert * self.num_experts

    @property
    def non_expert(self) -> int:
        return (
            self.attention + self.norms + self.dense_mlp + self.router + self.shared_expert + self.mtp_extra
        )

    @property
    def total(self) -> int:
        return self.non_expert + self.experts_total

    @property
    def active(self) -> int:
        return self.non_expert + self.expert * self.topk


@dataclass(frozen=True)
class ParamCount:
    model: str
    layers: tuple[LayerParams, ...]
    mtp_layers: tuple[LayerParams, ...]
    embedding: int
    position_embedding: int
    final_norm: int
    output_layer: int

    @property
    def all_layers(self) -> tuple[LayerParams, ...]:
        return self.layers + self.mtp_layers

    @property
    def total(self) -> int:
        return self.main_model + sum(layer.total for layer in self.mtp_layers)

    @property
    def main_model(self) -> int:
        """Without MTP: what a checkpoint of the main model (and the published size) counts."""
        tables = self.embedding + self.position_embedding + self.final_norm + self.output_layer
        return tables + sum(layer.total for layer in self.layers)

    @property
    def experts(self) -> int:
        return sum(layer.experts_total for layer in self.all_layers)

    @property
    def active(self) -> int:
        """Parameters one token touches in the main model (embeddings and output included)."""
        tables = self.embedding + self.position_embedding + self.final_norm + self.output_layer
        return tables + sum(layer.active for layer in self.layers)

    @property
    def active_matmul(self) -> int:
        """Active parameters that take part in a matmul per token: no embedding lookups, no norms."""
        layers = sum(layer.active - layer.norms for layer in self.layers)
        return layers + self.output_layer_matmul

    @property
    def output_layer_matmul(self) -> int:
        """The logits matmul runs whether or not the output weight is tied to the embedding."""
        return self.output_layer or self.embedding


def _linear(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def _norm(spec: ModelSpec, size: int) -> int:
    return size * (2 if spec.normalization == "LayerNorm" else 1)


def _mlp(spec: ModelSpec, width: int) -> int:
    fc1_out = width * (2 if spec.gated_linear_unit else 1)
    h = spec.hidden_size
    return _linear(h, fc1_out, spec.add_bias_linear) + _linear(width, h, spec.add_bias_linear)


def attention_params(spec: ModelSpec, shape: LayerShape) -> int:
    h, d = spec.hidden_size, spec.kv_channels
    q_width, kv_width = shape.num_heads * d, spec.num_query_groups * d
    qkv = _linear(h, q_width + 2 * kv_width, spec.add_qkv_bias)
    proj = _linear(q_width, h, spec.add_bias_linear)
    qk_norms = 2 * _norm(spec, d) if spec.qk_layernorm else 0
    gate = h * shape.num_heads if spec.attention_gate == "per_head" else 0
    return qkv + proj + qk_norms + gate


def layer_params(spec: ModelSpec, shape: LayerShape, label: str) -> LayerParams:
    h = spec.hidden_size
    common = {
        "label": label,
        "shape": shape,
        "attention": attention_params(spec, shape),
        "norms": 2 * _norm(spec, h),
    }
    if shape.ffn == "dense" or spec.moe is None:
        return LayerParams(**common, dense_mlp=_mlp(spec, spec.ffn_hidden_size))
    moe = spec.moe
    shared = _mlp(spec, moe.shared_expert_ffn_hidden_size) if moe.shared_expert_ffn_hidden_size else 0
    router = _linear(h, moe.num_experts, spec.add_bias_linear)
    return LayerParams(
        **common,
        router=router,
        expert=_mlp(spec, moe.ffn_hidden_size),
        num_experts=moe.num_experts,
        topk=moe.topk,
        shared_expert=shared,
    )


def mtp_layer_params(spec: ModelSpec, index: int) -> LayerParams:
    h = spec.hidden_size
    base = layer_params(spec, spec.mtp_layer(index), f"mtp{index}")
    extra = 2 * _norm(spec, h) + 2 * h * h + _norm(spec, h)  # enorm, hnorm, eh_proj, final norm
    return LayerParams(**{**base.__dict__, "mtp_extra": extra})


def count_parameters(spec: ModelSpec) -> ParamCount:
    h = spec.hidden_size
    layers = tuple(layer_params(spec, spec.layer(i), str(i)) for i in range(spec.num_layers))
    mtp = tuple(mtp_layer_params(spec, i) for i in range(spec.mtp_num_layers))
    learned = spec.position_embedding_type == "learned_absolute"
    return ParamCount(
        model=spec.name,
        layers=layers,
        mtp_layers=mtp,
        embedding=spec.vocab_size * h,
        position_embedding=spec.max_position_embeddings * h if learned else 0,
        final_norm=_norm(spec, h),
        output_layer=spec.vocab_size * h if spec.untie_embeddings_and_output_weights else 0,
    )
