"""What of the megatron engine runs on CPU: the config mapping from a rendered plan, and the model it builds
with megatron-core 0.16.1 (SDPA as core attention) -- forward and backward on CPU. The training step itself
needs CUDA and is verified on the H200 machine (docs/benchmarks.md)."""

from __future__ import annotations

from typing import Any

import pytest

from stepdeploy.catalog import load_model
from stepdeploy.plan.layout import Layout
from stepdeploy.plan.params import count_parameters
from stepdeploy.render.options import RenderOptions
from stepdeploy.render.workload import workload_config

torch = pytest.importorskip("torch")
mcore = pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
import data  # noqa: E402
import engine_megatron  # noqa: E402
import rope  # noqa: E402
import synthetic  # noqa: E402  (tests/unit/workload/conftest.py puts the workload directory on sys.path)


def cfg_for(model: str, layout: Layout, world: int = 1, **opts: Any) -> dict[str, Any]:
    options = RenderOptions(run_id="t", seq_length=32, global_batch_size=world * layout.mbs, **opts)
    return workload_config(load_model(model), layout, options, engine="megatron", world=world, peak_tflops=790.0)


def test_plan_maps_to_megatron_config_and_parallel_sizes() -> None:
    cfg = cfg_for("proxy-0.7b-moe", Layout(tp=2, pp=2, ep=4, etp=1, recompute="full"), world=16)
    kwargs = engine_megatron.transformer_config_kwargs(cfg)
    assert kwargs["tensor_model_parallel_size"] == 2 and kwargs["pipeline_model_parallel_size"] == 2
    assert kwargs["expert_model_parallel_size"] == 4 and kwargs["expert_tensor_parallel_size"] == 1
    assert kwargs["sequence_parallel"] is True
    assert kwargs["num_moe_experts"] == 8 and kwargs["moe_router_topk"] == 2 and kwargs["moe_ffn_hidden_size"] == 8192
    assert kwargs["moe_layer_freq"] == [1] * 12 and kwargs["moe_grouped_gemm"] is False
    assert kwargs["recompute_granularity"] == "full" and kwargs["recompute_num_layers"] == 1
    assert kwargs["activation_func"] is torch.nn.functional.gelu  # proxy: GELU MLP, not SwiGLU
    assert engine_megatron.parallel_sizes(cfg) == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "context_parallel_size": 1,
        "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1}
    dense = engine_megatron.transformer_config_kwargs(cfg_for("tiny-dense", Layout()))
    assert "num_moe_experts" not in dense and dense["sequence_parallel"] is False
    assert dense["activation_func"] is torch.nn.functional.silu
    # the fused RoPE path by default (rope.py's kernel without TE); off when the layout says so
    assert kwargs["apply_rope_fusion"] is True and dense["apply_rope_fusion"] is True
    unfused = engine_megatron.transformer_config_kwargs(cfg_for("tiny-dense", Layout(rope_fusion=False)))
    assert unfused["apply_rope_fusion"] is False


@pytest.mark.parametrize(("layout", "param_gather"), [
    (Layout(), True),  # unsettled (no cluster): megatron's advice; the planner settles it per cluster
    (Layout(overlap_param_gather=False), False),
    (Layout(distributed_optimizer=False), False),  # nothing to gather without the distributed optimizer
    (Layout(overlap_grad_reduce=False), False),
])
def test_ddp_config_follows_the_layout_param_gather_overlap_included(layout: Layout, param_gather: bool) -> None:
    kwargs = engine_megatron.ddp_config_kwargs(cfg_for("tiny-dense", layout, world=2))
    assert kwargs["overlap_param_gather"] is param_gather
    assert kwargs["overlap_grad_reduce"] is layout.overlap_grad_reduce
    assert kwargs["use_distributed_optimizer"] is layout.distributed_optimizer
    assert kwargs["grad_reduce_in_fp32"] is True
    assert kwargs["average_in_collective"] is True  # NCCL averages: no 1/DP pass over the gradient buffer
    mcore.distributed.DistributedDataParallelConfig(**kwargs)  # megatron-core accepts every key



@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_model_builds_on_cpu_with_sdpa_attention_and_learns(model: str, megatron_single_rank: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    # megatron-core's RoPE moves its frequencies to torch.cuda.current_device() on first use: keep them on CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")

    cfg = cfg_for(model, Layout(mbs=2))
    kwargs = engine_megatron.transformer_config_kwargs(cfg)
    kwargs |= {"bf16": False, "params_dtype": torch.float32, "pipeline_dtype": torch.float32,
               "use_cpu_initialization": True}
    if "num_moe_experts" in kwargs:  # 0.16.1's alltoall dispatcher allocates a torch.cuda.Stream at build time
        kwargs["moe_token_dispatcher_type"] = "allgather"
    rope.prepare(kwargs)  # as the engine's build() does
    gpt = engine_megatron.build_model(cfg, TransformerConfig(**kwargs))
    assert sum(p.numel() for p in gpt.parameters()) == count_parameters(load_model(model)).total
    cores = [m for m in gpt.modules() if type(m).__name__ == "SdpaAttention"]
    assert len(cores) == cfg["model"]["num_layers"]
    assert not [m for m in gpt.modules() if type(m).__name__ == "DotProductAttention"]
    table = synthetic.markov_table(cfg["model"]["vocab_size"], 1)
    pool = [synthetic.markov_tokens(table, 1, 1, micro, 0, 2, 33) for micro in range(2)]
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)
    optimizer = torch.optim.Adam(gpt.parameters(), lr=3e-3)
    losses = []
    for step in range(8):
        tokens = pool[step % 2]
        loss = gpt(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_sdpa_attention_matches_explicit_causal_softmax() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2)
    attention = engine_megatron.sdpa_core_attention()(config, 1, None)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 4, 8, generator=gen)  # [s, b, heads, d]
    k, v = torch.randn(5, 2, 2, 8, generator=gen), torch.randn(5, 2, 2, 8, generator=gen)
    out = attention(q, k, v, None)
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / 8**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(5, 5, dtype=torch.bool), 1), float("-inf"))
    expected = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(5, 2, 32)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_flash_attn_kernel_is_used_when_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a `flash_attn` module importable, bf16 attention goes through its flash_attn_func ([b, s, n, d]
    layout, causal, GQA by fewer k/v heads) and gives what the SDPA path gives; without it, SDPA."""
    import sys
    import types

    from megatron.core.transformer.transformer_config import TransformerConfig

    calls: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []

    def flash_attn_func(q: Any, k: Any, v: Any, softmax_scale: Any = None, causal: bool = False) -> Any:
        calls.append((tuple(q.shape), tuple(k.shape), causal))
        reps = q.shape[2] // k.shape[2]
        kk, vv = k.repeat_interleave(reps, dim=2), v.repeat_interleave(reps, dim=2)
        scores = torch.einsum("bshd,bthd->bhst", q.float(), kk.float()) * softmax_scale
        mask = torch.triu(torch.ones(q.shape[1], q.shape[1], dtype=torch.bool), 1)
        scores = scores.masked_fill(mask, float("-inf")) if causal else scores
        return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), vv.float()).to(q.dtype)

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 4, 8, generator=gen).bfloat16()
    k, v = torch.randn(6, 2, 2, 8, generator=gen).bfloat16(), torch.randn(6, 2, 2, 8, generator=gen).bfloat16()
    sdpa = engine_megatron.sdpa_core_attention()
    assert not sdpa.uses_flash_attn  # no flash-attn installed here
    expected = sdpa(config, 1, None, softmax_scale=8**-0.5)(q, k, v, None)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    flash = engine_megatron.sdpa_core_attention()
    assert flash.uses_flash_attn
    out = flash(config, 1, None, softmax_scale=8**-0.5)(q, k, v, None)
    assert calls == [((2, 6, 4, 8), (2, 6, 2, 8), True)]
    assert out.shape == (6, 2, 32)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    flash(config, 1, None, softmax_scale=8**-0.5)(q.float(), k.float(), v.float(), None)  # fp32: SDPA, not flash
    assert len(calls) == 1


def test_batches_depend_on_the_iteration_alone_so_a_resumed_run_sees_the_same_data() -> None:
    """Iteration k's micro-batches are the same whether the run started at 1 or resumed at k (a bug once counted
    micro-batches since the process started), and no micro-batch of a run repeats (the engine once cycled a pool of
    16: the soak's loss repeated with a period of 4 steps)."""
    cfg = cfg_for("tiny-dense", Layout(mbs=2))
    fresh = data.source_for(cfg, 0, 3, "cpu", megatron=True)
    resumed = data.source_for(cfg, 0, 3, "cpu", megatron=True)
    seen = {}
    for iteration in range(1, 25):
        for micro in range(3):
            tokens = fresh.micro_batch(iteration, micro)
            assert tokens.shape == (2, 33)
            seen[(iteration, micro)] = tokens
    for iteration in range(21, 25):
        for micro in range(3):
            assert torch.equal(resumed.micro_batch(iteration, micro), seen[(iteration, micro)])
    rows = {tuple(row.tolist()) for tokens in seen.values() for row in tokens}
    assert len(rows) == 2 * len(seen)  # every row of every micro-batch differs
    other_rank = data.source_for(cfg, 1, 3, "cpu", megatron=True).micro_batch(1, 0)
    assert not torch.equal(other_rank, seen[(1, 0)])


def test_config_overrides_come_from_a_json_object_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPDEPLOY_DDP_OVERRIDES", raising=False)
    assert engine_megatron.config_overrides(0, "STEPDEPLOY_DDP_OVERRIDES") == {}
    monkeypatch.setenv("STEPDEPLOY_DDP_OVERRIDES", '{"grad_reduce_in_fp32": false}')
    kwargs = engine_megatron.ddp_config_kwargs(cfg_for("tiny-dense", Layout(), world=2))
    merged = kwargs | engine_megatron.config_overrides(0, "STEPDEPLOY_DDP_OVERRIDES")
    assert merged["grad_reduce_in_fp32"] is False and merged["use_distributed_optimizer"] is True
    mcore.distributed.DistributedDataParallelConfig(**merged)
    monkeypatch.setenv("STEPDEPLOY_DDP_OVERRIDES", "[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        engine_megatron.config_overrides(0, "STEPDEPLOY_DDP_OVERRIDES")


def test_moe_communication_overlap_is_megatron_cores_and_only_where_it_has_something_to_hide() -> None:
    """Issue 38 item 3: the shared expert runs under the dispatcher's communication (moe_shared_expert_overlap)
    where there is some (EP x TP > 1, alltoall); the expert-parallel all-to-all overlap when the layout asks."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    def kwargs(layout: Layout) -> dict[str, Any]:
        return engine_megatron.transformer_config_kwargs(cfg_for("tiny-moe", layout, world=4))

    assert kwargs(Layout(tp=2))["moe_shared_expert_overlap"] is True
    assert kwargs(Layout(tp=2))["sequence_parallel"] is True
    assert kwargs(Layout(ep=2))["moe_shared_expert_overlap"] is True
    assert "moe_shared_expert_overlap" not in kwargs(Layout())  # no communication to hide
    assert "moe_shared_expert_overlap" not in kwargs(Layout(ep=2, dispatcher="allgather"))
    asked = kwargs(Layout(ep=2, overlap_moe_expert_parallel_comm=True))
    assert asked["overlap_moe_expert_parallel_comm"] is True and "moe_shared_expert_overlap" not in asked
    fields = TransformerConfig.__dataclass_fields__
    assert engine_megatron.known_config_kwargs(asked, fields) == asked  # megatron-core 0.16.1 has both
    assert "overlap_moe_expert_parallel_comm" not in engine_megatron.known_config_kwargs(asked, {"num_layers": 0})
