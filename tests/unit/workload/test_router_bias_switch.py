"""The megatron engine's switch for the routers' expert-bias update (workload.json `parallel.router_bias_update`,
default on): off, the bias is still built and used for the choice but moved by rate 0 -- the control run for the
Step-3.5-Flash slice's router collapse (docs/workload.md), which must still fail the soak's expert_load gate."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import engine_megatron  # conftest.py puts the workload directory on sys.path)

from stepdeploy.catalog import load_model


def _cfg(parallel: dict) -> dict:
    moe = load_model("step-3.5-flash-slice-1gpu").model_dump()["moe"]
    return {"moe": moe, "parallel": parallel}


@pytest.mark.parametrize("value", [False, "false", "off", "0"])
def test_the_switch_off_holds_the_expert_bias_at_zero(value: object) -> None:
    cfg = _cfg({"router_bias_update": value})
    kwargs = engine_megatron.load_balancing_kwargs(cfg["moe"], engine_megatron.router_bias_update(cfg["parallel"]))
    assert kwargs["moe_router_enable_expert_bias"] is True  # still chosen with (a zero bias): same model, same keys
    assert kwargs["moe_router_bias_update_rate"] == 0.0


@pytest.mark.parametrize("parallel", [{}, {"router_bias_update": True}, {"router_bias_update": "on"}])
def test_by_default_the_bias_moves_at_the_catalogs_rate(parallel: dict) -> None:
    cfg = _cfg(parallel)
    kwargs = engine_megatron.load_balancing_kwargs(cfg["moe"], engine_megatron.router_bias_update(cfg["parallel"]))
    assert kwargs["moe_router_bias_update_rate"] == cfg["moe"]["bias_update_rate"] == 1e-3


def test_a_zero_rate_leaves_the_bias_where_megatrons_update_would_move_it() -> None:
    """What finalize_model_grads computes (megatron-core's get_updated_expert_bias, without its all-reduce)."""
    torch = pytest.importorskip("torch")
    counts = torch.tensor([[40.0, 0.0, 0.0, 0.0]])  # one expert took every token
    bias = torch.zeros(1, 4)
    for rate, expected in ((1e-3, [-1e-3, 1e-3, 1e-3, 1e-3]), (0.0, [0.0, 0.0, 0.0, 0.0])):
        offset = counts.sum(dim=-1, keepdim=True) / counts.shape[-1] - counts
        assert (bias + torch.sign(offset) * rate).flatten().tolist() == pytest.approx(expected)


def test_render_writes_the_switch_only_when_it_is_off() -> None:
    """`--layout router_bias_update=off` reaches workload.json; the default leaves the rendering as it was."""
    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import parse_layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    def parallel(layout_text: str) -> dict:
        cfg = workload_config(load_model("tiny-moe"), parse_layout(layout_text), RenderOptions(run_id="t"),
                              engine="torch", world=1, peak_tflops=None)
        return cfg["parallel"]

    assert parallel("router_bias_update=off")["router_bias_update"] is False
    assert "router_bias_update" not in parallel("mbs=1")
