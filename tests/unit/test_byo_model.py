"""Bring your own model (issue 38 item 4): `--model` takes a catalog name, a model YAML of the catalog's schema,
or a Hugging Face config.json; what the megatron engine cannot build is refused by name (exit 2).

The three configs below are the published config.json fields of meta-llama/Meta-Llama-3-8B,
mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B (huggingface.co/<repo>/blob/main/config.json; token ids,
dtype and version fields left out). The exact counts were worked out by hand from those fields with megatron's
conventions (docs/planner.md, "Parameter counts"); the published sizes are the model cards'.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from stepdeploy.catalog import load_model, model_names, model_slug
from stepdeploy.catalog.hf_config import spec_from_hf_config
from stepdeploy.cli.app import main
from stepdeploy.errors import BadInput
from stepdeploy.plan.params import count_parameters

LLAMA_3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
}
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "vocab_size": 32000,
}
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936,
}


def _write(tmp_path: Path, config: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def _spec(config: dict[str, Any]) -> Any:
    return spec_from_hf_config(config, name="m", source="config.json")


def test_llama_3_8b_counts_its_published_8_03b(tmp_path: Path) -> None:
    spec = load_model(str(_write(tmp_path, LLAMA_3_8B)))
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_query_groups) == (32, 4096, 32, 8)
    assert (spec.kv_channels, spec.ffn_hidden_size, spec.vocab_size, spec.max_position_embeddings) == (
        128, 14336, 128256, 8192)
    assert spec.rope.theta == 500000.0 and spec.untie_embeddings_and_output_weights and spec.moe is None
    assert not (spec.add_qkv_bias or spec.qk_layernorm or spec.add_bias_linear) and spec.gated_linear_unit
    params = count_parameters(spec)
    assert params.total == 8_030_261_248  # 32 x 218,112,000 + 2 x 128256 x 4096 + 4096
    assert params.total == pytest.approx(8.03e9, rel=0.005)


def test_mixtral_8x7b_counts_its_published_46_7b_and_12_9b_active(tmp_path: Path) -> None:
    spec = load_model(str(_write(tmp_path, MIXTRAL_8X7B)))
    assert spec.moe is not None
    assert (spec.moe.num_experts, spec.moe.topk, spec.moe.ffn_hidden_size) == (8, 2, 14336)
    assert (spec.moe.first_dense_layers, spec.moe.shared_expert_ffn_hidden_size) == (0, 0)
    assert spec.moe.aux_loss_coeff == 0.02 and spec.sliding_window is None and spec.rope.theta == 1e6
    params = count_parameters(spec)
    assert (params.total, params.active) == (46_702_792_704, 12_879_925_248)
    assert params.total == pytest.approx(46.7e9, rel=0.005)
    assert params.active == pytest.approx(12.9e9, rel=0.005)


def test_qwen3_30b_a3b_counts_its_published_30_5b_and_3_3b_active(tmp_path: Path) -> None:
    directory = tmp_path / "Qwen3-30B-A3B"
    directory.mkdir()
    _write(directory, QWEN3_30B_A3B)
    spec = load_model(str(directory))  # a directory holding config.json
    assert spec.name == str(directory) and spec.qk_layernorm and not spec.add_qkv_bias
    assert (spec.kv_channels, spec.num_query_groups, spec.num_layers) == (128, 4, 48)  # head_dim != 2048 / 32
    assert spec.moe is not None
    assert (spec.moe.num_experts, spec.moe.topk, spec.moe.ffn_hidden_size) == (128, 8, 768)
    assert spec.moe.first_dense_layers == 0 and "rms_norm_eps 1e-06" in spec.description
    params = count_parameters(spec)
    assert (params.total, params.active) == (30_532_122_624, 3_353_032_704)
    assert params.total == pytest.approx(30.5e9, rel=0.005)
    # The card's "3.3B activated" is 3.35B cut to one decimal (embedding and output tables included; without
    # the input embedding it would be 3.04B): 1.6 % above 3.3B, within the published figure's last digit.
    assert 3.3e9 <= params.active < 3.4e9


def test_dense_families_map_their_biases_norms_and_rope() -> None:
    qwen2 = _spec({**LLAMA_3_8B, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096,
                   "tie_word_embeddings": True})
    assert qwen2.add_qkv_bias and not qwen2.qk_layernorm and not qwen2.untie_embeddings_and_output_weights
    assert qwen2.sliding_window is None  # Qwen's sliding_window is off unless use_sliding_window
    qwen3 = _spec({**LLAMA_3_8B, "model_type": "qwen3", "head_dim": 96})
    assert qwen3.qk_layernorm and not qwen3.add_qkv_bias and qwen3.kv_channels == 96
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    llama31 = _spec({**LLAMA_3_8B, "rope_scaling": scaling, "max_position_embeddings": 131072})
    assert llama31.rope.llama3_scaling is not None and llama31.rope.llama3_scaling.factor == 8.0
    assert llama31.training.seq_length == 4096 and llama31.training.global_batch_size == 256
    mistral = _spec({**LLAMA_3_8B, "model_type": "mistral", "sliding_window": 32768,
                     "max_position_embeddings": 32768})
    assert mistral.sliding_window is None  # a window as long as the longest sequence is full attention


def test_qwen_moe_dense_prefix_maps_to_first_dense_layers() -> None:
    spec = _spec({**QWEN3_30B_A3B, "mlp_only_layers": [0, 1]})
    assert spec.moe is not None and spec.moe.first_dense_layers == 2
    assert [layer.ffn for layer in spec.layers()[:3]] == ["dense", "dense", "moe"]
    assert _spec({**QWEN3_30B_A3B, "num_experts": 0}).moe is None


@pytest.mark.parametrize(("change", "words"), [
    ({"model_type": "deepseek_v3"}, "multi-head latent attention"),
    ({"model_type": "deepseek_v2"}, "multi-head latent attention"),
    ({"kv_lora_rank": 512}, "multi-head latent attention"),
    ({"model_type": "gemma2"}, "model_type gemma2 is not one the megatron engine builds"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window 4096 on every layer"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, "max_window_layers"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"layer_types": ["sliding_attention"] * 32, "sliding_window": 4096}, "sliding-window layers"),
])
def test_what_the_engine_cannot_build_is_refused_by_name(change: dict[str, Any], words: str) -> None:
    with pytest.raises(BadInput, match=words) as refusal:
        _spec({**LLAMA_3_8B, **change})
    assert "\n" not in refusal.value.message and refusal.value.exit_code == 2


@pytest.mark.parametrize(("change", "words"), [
    ({"norm_topk_prob": False}, "norm_topk_prob false"),
    ({"mlp_only_layers": [5]}, r"dense layers \[5\] between MoE layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 5632}, "shared_expert_gate"),
])
def test_qwen_moe_refusals(change: dict[str, Any], words: str) -> None:
    with pytest.raises(BadInput, match=words):
        _spec({**QWEN3_30B_A3B, **change})


def test_a_layer_types_pattern_of_the_engine_maps_to_its_window() -> None:
    types = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(32)]
    spec = _spec({**LLAMA_3_8B, "model_type": "mistral", "layer_types": types, "sliding_window": 512})
    assert (spec.sliding_window, spec.full_attention_every) == (512, 4)
    assert spec.layer(0).attention == "full" and spec.layer(1).attention == "sliding"


@pytest.mark.parametrize(("content", "words"), [
    ("{not json", "not a JSON Hugging Face config"),
    ("[1, 2]", "JSON object, not a list"),
    (json.dumps({k: v for k, v in LLAMA_3_8B.items() if k != "hidden_size"}), "missing field 'hidden_size'"),
    (json.dumps({**LLAMA_3_8B, "num_hidden_layers": "32"}), "num_hidden_layers must be an integer"),
    (json.dumps({"hidden_size": 8}), "no model_type"),
])
def test_bad_config_files_are_one_line_exit_2(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(BadInput, match=words) as refusal:
        load_model(str(path))
    assert "\n" not in refusal.value.message and str(path) in refusal.value.message


def test_missing_and_oversized_files(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="no such model file"):
        load_model(str(tmp_path / "absent.json"))
    with pytest.raises(BadInput, match="no such model file"):
        load_model(str(tmp_path))  # a directory without config.json
    big = tmp_path / "big.json"
    big.write_text(" " * (1024 * 1024 + 1))
    with pytest.raises(BadInput, match="refused"):
        load_model(str(big))
    with pytest.raises(BadInput, match="known: ") as unknown:
        load_model("llama-3-8b")
    assert unknown.value.hint and "config.json" in unknown.value.hint


def test_a_yaml_of_the_catalog_schema_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = resources.files("stepdeploy") / "data" / "models" / "tiny-moe.yaml"
    copy = tmp_path / "my-moe.yaml"
    with resources.as_file(source) as file:
        shutil.copy(file, copy)
    spec = load_model(str(copy))
    assert spec.name == str(copy) and "my-moe" not in model_names()
    assert spec.model_dump(exclude={"name"}) == load_model("tiny-moe").model_dump(exclude={"name"})
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "-m", str(copy), "--nodes", "1", "--gpus-per-node", "2", "--gpu", "H200", "--top", "1",
              "--json"])
    assert not exit_info.value.code
    plan = json.loads(capsys.readouterr().out)
    assert plan["fitting"]
    copy.write_text(copy.read_text().replace("num_layers: 4", "num_layers: -4"))
    with pytest.raises(BadInput, match=r"my-moe\.yaml: num_layers: "):
        load_model(str(copy))  # re-read once the file changed
    copy.write_text("- a list\n")
    with pytest.raises(BadInput, match="not a list"):
        load_model(str(copy))
    copy.write_text("name: x\nnum_layers: [\n")
    with pytest.raises(BadInput, match="not YAML"):
        load_model(str(copy))


def test_plan_refuses_an_mla_config_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {**LLAMA_3_8B, "model_type": "deepseek_v3", "kv_lora_rank": 512})
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "-m", str(path), "--nodes", "1", "--gpus-per-node", "8", "--gpu", "H100"])
    assert exit_info.value.code == 2
    assert "multi-head latent attention" in capsys.readouterr().err


def test_model_slug_names_a_file_for_run_ids(tmp_path: Path) -> None:
    directory = tmp_path / "Meta Llama-3-8B"
    directory.mkdir()
    config = _write(directory, LLAMA_3_8B)
    assert model_slug("tiny-moe") == "tiny-moe"
    assert model_slug(str(directory)) == model_slug(str(config)) == "Meta-Llama-3-8B"
    assert model_slug(str(tmp_path / "my model.yaml")) == "my-model"


def test_render_and_rollout_name_a_model_file_by_its_slug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Without --run-id / --run-dir, the run is named after the file (its path is no run id), and the rollout keeps
    the file by its absolute path (`rollout resume` may run from elsewhere)."""
    source = resources.files("stepdeploy") / "data" / "models" / "tiny-moe.yaml"
    (tmp_path / "models").mkdir()
    with resources.as_file(source) as file:
        shutil.copy(file, tmp_path / "models" / "my-moe.yaml")
    inventory = tmp_path / "inv.ini"
    inventory.write_text("[cpu]\nn1 ansible_host=192.0.2.1\n[cpu:vars]\nstepdeploy_gpus_per_node=0\n"
                         "stepdeploy_profile=sim-standin\nstepdeploy_fabric=ethernet\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["render", "-i", str(inventory), "-m", "models/my-moe.yaml", "--out", str(tmp_path / "r1"),
              "--dry-run", "--json"])
    assert not exit_info.value.code, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["run_id"].startswith("my-moe-warmup-")
    with pytest.raises(SystemExit) as exit_info:
        main(["rollout", "run", "-i", str(inventory), "-m", "models/my-moe.yaml", "--dry-run"])
    assert not exit_info.value.code, capsys.readouterr().err
    assert f'"model": "{tmp_path / "models" / "my-moe.yaml"}"' in capsys.readouterr().out
