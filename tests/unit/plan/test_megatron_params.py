"""The planner's parameter count equals megatron-core's own, built on CPU (no training step).

Needs torch and megatron-core (0.16.1 is what pip resolves on Python 3.11); skipped otherwise:
    python -m venv /tmp/venv-mcore && /tmp/venv-mcore/bin/pip install -e . pytest \
        torch==2.13.0 megatron-core==0.16.1
    /tmp/venv-mcore/bin/pytest tests/unit/plan/test_megatron_params.py
"""

from __future__ import annotations

from typing import Any

import pytest

from stepdeploy.catalog import ModelSpec, load_model
from stepdeploy.plan.params import count_parameters

mcore = pytest.importorskip(
    "megatron.core", reason="megatron-core not importable (pip install torch megatron-core==0.16.1)"
)
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", autouse=True)
def _single_process_group(megatron_single_rank: None) -> None:
    """megatron-core's parallel state for every test here (tests/unit/conftest.py)."""


def _transformer_config(spec: ModelSpec) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: dict[str, Any] = {}
    if spec.moe:
        dense = spec.moe.first_dense_layers
        moe = {
            "num_moe_experts": spec.moe.num_experts,
            "moe_router_topk": spec.moe.topk,
            "moe_ffn_hidden_size": spec.moe.ffn_hidden_size,
            "moe_shared_expert_intermediate_size": spec.moe.shared_expert_ffn_hidden_size or None,
            "moe_layer_freq": [0] * dense + [1] * (spec.num_layers - dense),
            "moe_router_score_function": spec.moe.score_function,
            "moe_router_enable_expert_bias": spec.moe.router_expert_bias,
        }
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization=spec.normalization,
        gated_linear_unit=spec.gated_linear_unit,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        mtp_num_layers=spec.mtp_num_layers or None,
        use_cpu_initialization=True,
        perform_initialization=False,  # the count needs the shapes, not random weights (saves minutes on CPU)
        pipeline_dtype=torch.float32,
        **moe,
    )


def build_megatron_model(spec: ModelSpec) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    config = _transformer_config(spec)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=spec.normalization)
    mtp = None
    if spec.mtp_num_layers:
        experts = spec.moe.num_experts if spec.moe and spec.mtp_ffn == "moe" else None
        layer = get_gpt_layer_local_spec(
            experts, qk_layernorm=spec.qk_layernorm, normalization=spec.normalization
        )
        mtp = get_gpt_mtp_block_spec(config, layer, use_transformer_engine=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        share_embeddings_and_output_weights=not spec.untie_embeddings_and_output_weights,
        position_embedding_type=spec.position_embedding_type,
        mtp_block_spec=mtp,
    )


def megatron_count(spec: ModelSpec) -> int:
    return sum(param.numel() for param in build_megatron_model(spec).parameters())


def _variant(base: str, **changes: Any) -> ModelSpec:
    data = load_model(base).model_dump()
    moe_changes = changes.pop("moe", None)
    if moe_changes is not None:
        data["moe"] = {**(data["moe"] or {}), **moe_changes}
    return ModelSpec.model_validate({**data, **changes, "name": f"{base}-variant"})


CASES = {
    "tiny-dense (GQA, SwiGLU, RMSNorm, untied)": lambda: load_model("tiny-dense"),
    "tiny-moe (shared expert, first layer dense)": lambda: load_model("tiny-moe"),
    "proxy-0.7b-dense": lambda: load_model("proxy-0.7b-dense"),
    "proxy-0.7b-moe": lambda: load_model("proxy-0.7b-moe"),
    "GPT-3 style (LayerNorm, biases, learned positions, tied)": lambda: _variant(
        "gpt3-175b-seed",
        num_layers=2,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=8,
        kv_channels=32,
        ffn_hidden_size=1024,
        vocab_size=1000,
        max_position_embeddings=128,
    ),
    "qk-layernorm + MoE without shared expert + 2 dense MTP layers": lambda: _variant(
        "tiny-moe",
        qk_layernorm=True,
        mtp_num_layers=2,
        moe={"shared_expert_ffn_hidden_size": 0, "first_dense_layers": 0},
    ),
    "MTP layers with MoE FFN, sigmoid router": lambda: _variant(
        "tiny-moe", mtp_num_layers=1, mtp_ffn="moe", moe={"score_function": "sigmoid"}
    ),
    # megatron-core 0.16.1 allocates the router expert bias with torch.cuda: not buildable on CPU.
    # Shared experts refuse biases ("bias is not supported in the shared experts").
    "LayerNorm MoE with biases, tied": lambda: _variant(
        "tiny-moe",
        normalization="LayerNorm",
        add_bias_linear=True,
        add_qkv_bias=True,
        untie_embeddings_and_output_weights=False,
        moe={"shared_expert_ffn_hidden_size": 0},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parameter_count_equals_megatron_core(case: str) -> None:
    spec = CASES[case]()
    assert count_parameters(spec).total == megatron_count(spec)


def test_the_tiny_moe_count_is_the_one_computed_by_hand() -> None:
    # Pinned so this file still fails if both sides drift together: see test_params.py for the sum.
    assert megatron_count(load_model("tiny-moe")) == 10_825_984
