"""The torch engine balances its experts as the catalog says (megatron-core's two schemes): the switch auxiliary
loss, or an expert bias that changes the choice (not the weights) and moves towards the mean load each step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def moe_config(**moe: object) -> dict:
    return {"hidden_size": 16, "gated_linear_unit": True,
            "moe": {"num_experts": 4, "topk": 2, "ffn_hidden_size": 8, "shared_expert_ffn_hidden_size": 0,
                    "score_function": "softmax", "router_expert_bias": False, "load_balancing": "aux_loss",
                    "aux_loss_coeff": 1e-2, "bias_update_rate": 1e-3} | moe}


def test_the_aux_loss_is_megatrons_switch_loss_and_trains_the_router() -> None:
    from engine_torch import Moe

    torch.manual_seed(0)
    layer = Moe(moe_config())
    x = torch.randn(3, 5, 16)
    layer(x)
    probs = layer.router(x.reshape(-1, 16)).softmax(-1)
    counts = torch.bincount(probs.topk(2, dim=-1).indices.flatten(), minlength=4).float()
    expected = (probs.sum(0) * counts).sum() * 4 * 1e-2 / (15 * 15 * 2)
    assert layer.aux is not None and torch.allclose(layer.aux, expected)
    layer.aux.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    with torch.no_grad():
        layer(x)
    assert layer.aux is None  # no loss outside training
    assert Moe(moe_config(aux_loss_coeff=0.0))(x) is not None and Moe(moe_config(aux_loss_coeff=0.0)).aux is None


def test_the_expert_bias_moves_the_choice_towards_the_mean_load_not_the_weights() -> None:
    from engine_torch import Moe

    torch.manual_seed(0)
    layer = Moe(moe_config(score_function="sigmoid", router_expert_bias=True, load_balancing="expert_bias",
                           aux_loss_coeff=0.0))
    x = torch.randn(64, 16)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 5.0  # expert 0 wins every token with x[:, 0] > 0
    layer(x)
    assert layer.aux is None
    load = layer.tokens_per_expert.clone()
    layer.update_bias()
    assert torch.equal(layer.expert_bias, 1e-3 * torch.sign(load.mean() - load))
    assert layer.expert_bias[0] < 0 and layer.tokens_per_expert.sum() == 0  # counts cleared for the next step
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([-10.0, 0.0, 0.0, 0.0]))  # a bias this large: expert 0 never chosen
        out = layer(x)
    assert layer.tokens_per_expert.sum() == 0  # no counting outside training
    with torch.no_grad():
        layer.expert_bias.zero_()
        same = layer(x)
    assert not torch.allclose(out, same)  # the choice changed; the weights still come from the unbiased scores
