"""FLOPs per token by hand, and the step-time model against the H200 measurements it is calibrated on."""

from __future__ import annotations

import pytest

from stepdeploy.catalog import load_hardware, load_model
from stepdeploy.plan.cluster import cluster_shape
from stepdeploy.plan.flops import attention_context, layer_flops, model_flops_per_token
from stepdeploy.plan.layout import Job, Layout
from stepdeploy.plan.params import count_parameters
from stepdeploy.plan.steptime import predict_step_time


def test_tiny_dense_flops_per_token_by_hand() -> None:
    # Per layer: 6 x (196,608 attention + 528,384 MLP matmul params) + 12 x 256 (q width) x 256 (seq).
    layer = 6 * (196_608 + 528_384) + 12 * 256 * 256
    logits = 6 * 8192 * 256
    flops = model_flops_per_token(count_parameters(load_model("tiny-dense")), load_model("tiny-dense"), 256)
    assert flops.total == 4 * layer + logits == 33_128_448
    assert flops.expert == 0


def test_sliding_window_layers_use_the_average_causal_context() -> None:
    spec = load_model("step-3.5-flash")
    layer = count_parameters(spec).layers[1]
    assert attention_context(spec, layer, 4096) == 512 - 512 * 511 / (2 * 4096) == 480.0625
    assert attention_context(spec, count_parameters(spec).layers[0], 4096) == 4096


def test_full_recompute_adds_one_forward() -> None:
    spec = load_model("tiny-dense")
    layer = count_parameters(spec).layers[0]
    base = layer_flops(spec, layer, 256).total
    assert layer_flops(spec, layer, 256, "full").total == pytest.approx(base * 4 / 3)


def test_moe_expert_flops_count_topk_experts_only() -> None:
    spec = load_model("tiny-moe")
    layer = count_parameters(spec).layers[1]
    assert layer_flops(spec, layer, 256).expert == 6 * 2 * (3 * 256 * 256)


def test_dense_proxy_on_one_h200_predicts_the_measured_throughput() -> None:
    spec = load_model("proxy-0.7b-dense")
    time = predict_step_time(
        count_parameters(spec),
        Job(spec, 2048, 32, 1),
        Layout(mbs=4, rope_fusion=False),  # measured before the fused RoPE
        cluster_shape(1, 1, "H200", "ib-400g"),
        load_hardware(),
    )
    # docs/benchmarks.md (H200, mcore 0.19.2 + SDPA, 2026-11-29): 101,007 tok/s, 59.2 % MFU
    assert time.tokens_per_second == pytest.approx(101_007, rel=0.05)
    assert time.mfu == pytest.approx(0.592, abs=0.02)


def test_moe_proxy_with_sequential_experts_predicts_the_measured_mfu() -> None:
    spec = load_model("proxy-0.7b-moe")
    time = predict_step_time(
        count_parameters(spec),
        Job(spec, 2048, 32, 1),
        Layout(mbs=4, grouped_gemm=False, rope_fusion=False),
        cluster_shape(1, 1, "H200", "ib-400g"),
        load_hardware(),
    )
    # docs/benchmarks.md (H200, SequentialMLP, MBS 4, 2026-11-29): 41,115 tok/s, 36.7 % MFU
    assert time.mfu == pytest.approx(0.367, abs=0.02)
