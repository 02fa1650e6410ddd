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
