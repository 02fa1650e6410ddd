"""Training FLOPs per token and per step (Megatron's num_floating_point_operations conventions).

Per token: 6 x the matmul parameters a token meets (MoE: top-k experts + shared expert + router) plus
attention 12 x (query width) x context per layer, where full-attention layers count the whole sequence
(Megatron counts s^2, not the causal half) and sliding-window layers their average causal context
w - w(w-1)/(2s). MTP layers and their logits are included. `hardware` adds what recompute re-runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepdeploy.catalog import ModelSpec
from stepdeploy.plan.layout import Layout
from stepdeploy.plan.params import LayerParams, ParamCount


@dataclass(frozen=True)
class Flops:
    """FLOPs for ONE token, forward + backward."""

    dense: float  # non-expert matmuls, attention core, logits
    expert: float  # routed-expert matmuls

    @property
    def total(self) -> float:
        return self.dense + self.expert

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.dense + other.dense, self.expert + other.expert)

    def scaled(self, factor: float) -> Flops:
        return Flops(self.dense * factor, self.expert * factor)


ZERO = Flops(0.0, 0.0)


def attention_context(spec: ModelSpec, layer: LayerParams, seq_length: int) -> float:
    window = layer.shape.window
    if window is None or window >= seq_length:
        return float(seq_length)
    return window - window * (window - 1) / (2 * seq_length)


def _layer_forward(spec: ModelSpec, layer: LayerParams, seq_length: int) -> Flops:
    routed = layer.expert * layer.topk
    dense_matmul = layer.active - routed - layer.norms
    core = 4 * layer.shape.num_heads * spec.kv_channels * attention_context(spec, layer, seq_length)
    return Flops(dense=2 * dense_matmul + core, expert=2 * routed)


def _attention_core_forward(spec: ModelSpec, layer: LayerParams, seq_length: int) -> float:
    return 4 * layer.shape.num_heads * spec.kv_channels * attention_context(spec, layer, seq_length)


def layer_flops(spec: ModelSpec, layer: LayerParams, seq_length: int, recompute: str = "none") -> Flops:
    """Per token, forward + backward (3 x forward), plus the re-run forward that recompute costs."""
    forward = _layer_forward(spec, layer, seq_length)
    total = forward.scaled(3)
    if recompute == "full":
        total = total + forward
    elif recompute == "selective":
        total = total + Flops(_attention_core_forward(spec, layer, seq_length), 0.0)
    return total


def logits_flops(params: ParamCount) -> float:
    return 6.0 * params.output_layer_matmul


def model_flops_per_token(params: ParamCount, spec: ModelSpec, seq_length: int) -> Flops:
    """The MFU numerator: no recompute."""
    total = ZERO
    for layer in params.all_layers:
        total = total + layer_flops(spec, layer, seq_length)
    heads = 1 + len(params.mtp_layers)
    return total + Flops(heads * logits_flops(params), 0.0)


def model_flops_per_step(params: ParamCount, spec: ModelSpec, seq_length: int, global_batch: int) -> float:
    return model_flops_per_token(params, spec, seq_length).total * seq_length * global_batch


def stage_flops_per_token(
    params: ParamCount,
    spec: ModelSpec,
    layers: tuple[LayerParams, ...],
    last: bool,
    seq_length: int,
    layout: Layout,
) -> Flops:
    """Hardware FLOPs (recompute included) of one pipeline stage's layers, per token."""
    total = ZERO
    for layer in layers:
        total = total + layer_flops(spec, layer, seq_length, layout.recompute)
    if last:
        total = total + Flops((1 + len(params.mtp_layers)) * logits_flops(params), 0.0)
    return total
