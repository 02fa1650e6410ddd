"""layers.py's clamped SwiGLU MLPs under TransformerConfig.bias_activation_fusion (megatron-core 0.16.1, CPU): the flag
that makes megatron's own MLP run its fused SwiGLU makes a clamped MLP (Step-3.5-Flash's dense and shared experts
with a limit) run the fused clamped one, with the same output and gradients; without it, the eager one; and the
clamped SwiGLU compiles whole (one graph) and matches eager, as it runs on a GPU."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
import layers  # noqa: E402  (tests/unit/workload/conftest.py puts the workload directory on sys.path)

from tests.unit.workload.compiled_check import assert_compiled_matches_eager  # noqa: E402

F = torch.nn.functional
HIDDEN, FFN, LIMIT = 32, 48, 0.5


def clamped_mlp(fusion: bool) -> Any:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                               bias_activation_fusion=fusion, use_cpu_initialization=True)
    torch.manual_seed(0)
    return layers.mlp_class(LIMIT)(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                         linear_fc2=RowParallelLinear))


def test_the_fusion_flag_picks_the_fused_clamped_swiglu_with_the_same_result(
        megatron_single_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fused_calls: list[tuple[int, ...]] = []
    fused_impl = layers.fused_clamped_swiglu

    def counted(x: torch.Tensor, limit: float) -> torch.Tensor:
        fused_calls.append(tuple(x.shape))
        return fused_impl(x, limit)

    monkeypatch.setattr(layers, "fused_clamped_swiglu", counted)
    x = torch.randn(6, 2, HIDDEN, generator=torch.Generator().manual_seed(1)) * 3
    results = {}
    for fusion in (False, True):
        mlp = clamped_mlp(fusion)
        inp = x.clone().requires_grad_()
        out, _ = mlp(inp)
        out.sum().backward()
        results[fusion] = (out.detach(), inp.grad, [p.grad for p in mlp.parameters()])
        assert len(fused_calls) == int(fusion)  # eager without the flag, the fused one with it
    assert fused_calls == [(6, 2, 2 * FFN)]
    (plain, plain_dx, plain_dw), (fused, fused_dx, fused_dw) = results[False], results[True]
    assert torch.equal(plain, fused) and torch.equal(plain_dx, fused_dx)
    assert all(torch.equal(a, b) for a, b in zip(plain_dw, fused_dw, strict=True))


def test_the_clamped_swiglu_compiles_to_one_graph_and_matches_eager() -> None:
    pytest.importorskip("torch._inductor")
    torch._dynamo.reset()
    compiled = torch.compile(layers.clamped_swiglu, fullgraph=True)  # a graph break would raise here
    x = (torch.randn(16, 2 * FFN, generator=torch.Generator().manual_seed(2)) * 2).requires_grad_()
    gate, up = x.detach().chunk(2, dim=-1)
    assert (F.silu(gate) > LIMIT).any() and (up.abs() > LIMIT).any()  # both clamps bind somewhere
    assert_compiled_matches_eager(compiled, layers.clamped_swiglu, x, LIMIT)
