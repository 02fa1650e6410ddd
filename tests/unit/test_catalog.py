"""The catalog: every model and GPU loads, carries sources, and Step-3.5-Flash is exactly FACTS'."""

from __future__ import annotations

import pytest

from stepdeploy.catalog import gpu, link, load_hardware, load_model, model_names, parse_model
from stepdeploy.errors import BadInput


def test_catalog_lists_the_models_issue_5_asks_for() -> None:
    assert set(model_names()) >= {
        "step-3.5-flash",
        "gpt3-175b-seed",
        "tiny-dense",
        "tiny-moe",
        "proxy-0.7b-dense",
        "proxy-0.7b-moe",
    }


@pytest.mark.parametrize("name", model_names())
def test_every_model_names_its_sources(name: str) -> None:
    assert load_model(name).sources


def test_step_35_flash_matches_its_hugging_face_config() -> None:
    spec = load_model("step-3.5-flash")
    assert (spec.num_layers, spec.mtp_num_layers, spec.hidden_size, spec.kv_channels) == (45, 3, 4096, 128)
    assert (spec.num_attention_heads, spec.sliding_num_attention_heads, spec.num_query_groups) == (64, 96, 8)
    assert (spec.sliding_window, spec.ffn_hidden_size, spec.vocab_size) == (512, 11264, 128_896)
    assert spec.moe is not None
    assert (spec.moe.num_experts, spec.moe.topk, spec.moe.ffn_hidden_size) == (288, 8, 1280)
    assert (spec.moe.shared_expert_ffn_hidden_size, spec.moe.first_dense_layers) == (1280, 3)
    kinds = [(layer.attention, layer.ffn) for layer in spec.layers()]
    assert kinds[:5] == [
        ("full", "dense"),
        ("sliding", "dense"),
        ("sliding", "dense"),
        ("sliding", "moe"),
        ("full", "moe"),
    ]
    assert sum(kind == "full" for kind, _ in kinds) == 12  # i % 4 == 0 for i in 0..44
    assert spec.layer(1).num_heads == 96 and spec.layer(4).num_heads == 64


def test_the_seed_model_is_gpt3_175b_dense() -> None:
    spec = load_model("gpt3-175b-seed")
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.moe) == (96, 12288, 96, None)


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(BadInput, match=r"known: .*step-3\.5-flash"):
        load_model("step-3.5")


def test_a_bad_model_file_is_one_line_naming_the_field() -> None:
    data = load_model("tiny-dense").model_dump() | {"num_query_groups": 3}
    with pytest.raises(BadInput, match="multiple of num_query_groups"):
        parse_model(data, origin="x.yaml")


def test_gpus_carry_memory_peak_bandwidth_and_link() -> None:
    h200 = gpu("h200")
    assert (h200.memory_mib, h200.bf16_dense_tflops, h200.bf16_measured_tflops) == (143771, 989, 790)
    assert load_hardware().peak_tflops(h200) == 790
    assert load_hardware().peak_tflops(gpu("H100")) == pytest.approx(989 * 0.8)
    assert gpu("GB10").unified_memory and gpu("GB10").intra_node_link is None
    assert {gpu(name).arch for name in ("H100", "B200", "GB10")} == {"sm_90", "sm_100", "sm_121"}


def test_links_and_fabrics() -> None:
    assert link("ib-400g").busbw_gbps == 48 and link("roce-200g").busbw_gbps == 23.7
    assert load_hardware().fabric_links == {
        "infiniband": "ib-400g",
        "roce": "roce-200g",
        "ethernet": "ethernet-tcp",
    }
    with pytest.raises(BadInput, match="known: "):
        link("ib-800g")


def test_step_35_flash_rope_norms_router_and_clamps_follow_its_config() -> None:
    spec = load_model("step-3.5-flash")
    full, sliding = spec.layer(0), spec.layer(1)
    assert (full.rope.theta, full.rope.rotary_percent) == (5e6, 0.5)  # rope_theta / partial_rotary_factors
    assert full.rope.llama3_scaling is not None and full.rope.llama3_scaling.factor == 2.0  # yarn_only_types
    assert (sliding.rope.theta, sliding.rope.rotary_percent, sliding.rope.llama3_scaling) == (1e4, 1.0, None)
    mtp = spec.mtp_layer(2)
    assert (mtp.index, mtp.attention, mtp.ffn, mtp.num_heads, mtp.rope.theta) == (47, "sliding", "dense", 96, 1e4)
    assert spec.norm_zero_centered and not spec.uniform_attention
    assert [(i, spec.layer(i).swiglu_limit, spec.layer(i).shared_swiglu_limit) for i in (42, 43, 44)] == [
        (42, None, None), (43, 7.0, None), (44, 7.0, 16.0)]
    assert spec.moe is not None and spec.moe.load_balancing == "expert_bias" and spec.moe.router_fp32
    assert load_model("proxy-0.7b-moe").uniform_attention  # the proxies keep megatron's stock layers


@pytest.mark.parametrize("name", ["step-3.5-flash-slice-1gpu", "step-3.5-flash-slice-ep2"])
def test_the_slices_keep_every_width_and_setting_of_the_target(name: str) -> None:
    target, cut = load_model("step-3.5-flash").model_dump(), load_model(name).model_dump()
    kept = ("hidden_size", "num_attention_heads", "sliding_num_attention_heads", "num_query_groups", "kv_channels",
            "sliding_window", "full_attention_every", "ffn_hidden_size", "vocab_size", "rope", "sliding_rope",
            "norm_zero_centered", "qk_layernorm", "attention_gate", "gated_linear_unit", "mtp_attention", "mtp_ffn")
    assert {k: cut[k] for k in kept} == {k: target[k] for k in kept}
    moe_kept = ("topk", "ffn_hidden_size", "shared_expert_ffn_hidden_size", "score_function", "router_scaling_factor",
                "router_expert_bias", "router_fp32", "load_balancing", "bias_update_rate")
    assert {k: cut["moe"][k] for k in moe_kept} == {k: target["moe"][k] for k in moe_kept}
    spec = load_model(name)
    kinds = [(layer.attention, layer.ffn, layer.num_heads) for layer in spec.layers()]
    assert kinds == [("full", "dense", 64)] + [("sliding", "moe", 96)] * 3  # 1:3, one dense lead layer
    assert spec.mtp_num_layers == 1 and spec.training.seq_length == 4096
    # the target's clamped last two MoE layers map to the slice's last two
    assert (spec.swiglu_limits, spec.swiglu_limits_shared) == ({2: 7.0, 3: 7.0}, {3: 16.0})


@pytest.mark.parametrize(("change", "message"), [
    ({"swiglu_limits": {99: 7.0}}, "swiglu_limits: layer 99"),
    ({"swiglu_limits": {3: -1.0}}, "swiglu_limits: layer 3"),
    ({"moe": {"num_experts": 8, "topk": 2, "ffn_hidden_size": 64, "load_balancing": "expert_bias"}},
     "expert_bias needs router_expert_bias"),
])
def test_bad_step_settings_are_one_line_naming_the_field(change: dict, message: str) -> None:
    data = load_model("step-3.5-flash-slice-1gpu").model_dump() | change
    with pytest.raises(BadInput, match=message):
        parse_model(data, origin="bad.yaml")
