"""Parameter counts, checked against sums written out by hand."""

from __future__ import annotations

from stepdeploy.catalog import load_model
from stepdeploy.plan.params import count_parameters

# tiny-moe: h=256, 8 heads x 32 (q width 256), 4 query groups (kv width 128), SwiGLU, RMSNorm, untied.
ATTENTION = 256 * (256 + 2 * 128) + 256 * 256  # linear_qkv + linear_proj = 196,608
NORMS = 2 * 256  # input and pre-MLP RMSNorm weights
DENSE_MLP = 256 * 2 * 688 + 688 * 256  # fc1 (gate+up) + fc2 = 528,384
EXPERT = 256 * 2 * 256 + 256 * 256  # one 256-wide SwiGLU expert = 196,608
ROUTER = 8 * 256
MOE_LAYER = ATTENTION + NORMS + ROUTER + 8 * EXPERT + EXPERT  # 8 routed + 1 shared = 1,968,640
TABLES = 2 * 8192 * 256 + 256  # embedding + untied output layer + final norm


def test_tiny_moe_total_by_hand() -> None:
    dense_layer = ATTENTION + NORMS + DENSE_MLP
    assert (
        count_parameters(load_model("tiny-moe")).total == dense_layer + 3 * MOE_LAYER + TABLES == 10_825_984
    )


def test_tiny_moe_active_counts_top2_plus_the_shared_expert() -> None:
    active_moe = ATTENTION + NORMS + ROUTER + 2 * EXPERT + EXPERT
    expected = ATTENTION + NORMS + DENSE_MLP + 3 * active_moe + TABLES
    assert count_parameters(load_model("tiny-moe")).active == expected == 7_287_040


def test_per_layer_breakdown_of_tiny_moe() -> None:
    counts = count_parameters(load_model("tiny-moe"))
    first, second = counts.layers[0], counts.layers[1]
    assert (first.attention, first.dense_mlp, first.experts_total) == (ATTENTION, DENSE_MLP, 0)
    assert (second.router, second.expert, second.num_experts, second.shared_expert) == (
        ROUTER,
        EXPERT,
        8,
        EXPERT,
    )


def test_step_35_flash_total_within_half_a_percent_of_196_81b() -> None:
    counts = count_parameters(load_model("step-3.5-flash"))
    assert counts.main_model == 196_956_118_272
    assert abs(counts.main_model / 196.81e9 - 1) < 0.005  # 0.074 % high
    # Each MTP layer: sliding attention + 2 norms + dense SwiGLU 11264 + enorm, hnorm, eh_proj, final norm.
    mtp_layer = 109_445_376 + 2 * 4096 + 3 * 4096 * 11264 + (3 * 4096 + 2 * 4096 * 4096)
    assert counts.total - counts.main_model == 3 * mtp_layer == 3 * 281_432_320
    assert 10.5e9 < counts.active < 12.5e9  # 11.99B with embeddings, 10.93B without


def test_step_35_flash_layer_kinds_by_hand() -> None:
    counts = count_parameters(load_model("step-3.5-flash"))
    h = 4096
    gate_full, gate_sliding = h * 64, h * 96
    full = h * (64 * 128 + 2 * 8 * 128) + 64 * 128 * h + 2 * 128 + gate_full
    sliding = h * (96 * 128 + 2 * 8 * 128) + 96 * 128 * h + 2 * 128 + gate_sliding
    assert counts.layers[0].attention == full == 75_759_872
    assert counts.layers[1].attention == sliding == 109_445_376
    expert = 3 * h * 1280
    assert counts.layers[3].experts_total == 288 * expert
    assert counts.layers[3].active == sliding + 2 * h + 288 * h + 8 * expert + expert


def test_gpt3_seed_is_175b() -> None:
    # 96 layers x (12 h^2 + 13 h) + vocab x h + positions x h (tied output): GPT-3's 175B.
    h = 12288
    expected = 96 * (12 * h * h + 13 * h) + 50257 * h + 2048 * h + 2 * h
    assert count_parameters(load_model("gpt3-175b-seed")).total == expected == 174_604_259_328
