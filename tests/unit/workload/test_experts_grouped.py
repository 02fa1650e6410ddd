"""experts_grouped.GroupedMMExperts against megatron-core's own SequentialMLP (0.16.1, on CPU, bf16): the same
initialization from the same seed, the same outputs and gradients (inputs, probs, every expert's weights) with
identical weights for several routings (an expert with no token, all tokens on one expert, no token at all),
a dist-checkpointing round trip, and the plug-in into the engine's layer spec."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
if not hasattr(torch, "_grouped_mm"):
    pytest.skip("torch without torch._grouped_mm", allow_module_level=True)
import experts_grouped  # noqa: E402
from synthetic import markov_table, markov_tokens  # noqa: E402  (tests/unit/workload/conftest.py puts the workload directory on sys.path)

F = torch.nn.functional
HIDDEN, FFN, EXPERTS = 64, 96, 4
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


ROUTINGS = {"balanced": [12, 12, 12, 12], "zero-expert": [20, 0, 9, 19], "one-expert": [0, 0, 37, 0],
            "no-token": [0, 0, 0, 0]}



def make_config(gated: bool, **extra: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=4 * HIDDEN,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_router_topk=2, gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu, add_bias_linear=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True)
    return TransformerConfig(**(kwargs | extra))


def sequential(config: Any, seed: int) -> Any:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    torch.manual_seed(seed)
    return SequentialMLP(EXPERTS, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                        linear_fc2=RowParallelLinear),
                         pg_collection=get_default_pg_collection())


def grouped(config: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    return experts_grouped.experts_class()(EXPERTS, config)


def copy_weights(seq: Any, ours: Any, shift: int = 0) -> None:
    """SequentialMLP's expert e (fc1 [out, in], fc2 [out, in]) into our stacked [e, in, out] weights; shift != 0
    maps the wrong expert (the tests must then fail)."""
    with torch.no_grad():
        for e in range(EXPERTS):
            src = seq.local_experts[(e + shift) % EXPERTS]
            ours.weight1[e].copy_(src.linear_fc1.weight.t())
            ours.weight2[e].copy_(src.linear_fc2.weight.t())


def run(module: Any, counts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(counts)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).requires_grad_()
    probs = torch.rand(tokens, generator=gen).requires_grad_()  # the router's probs are float32
    grad = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    out, bias = module(x, torch.tensor(counts), probs)
    assert bias is None and out.dtype == torch.bfloat16 and out.shape == (tokens, HIDDEN)
    out.backward(grad)
    return out.detach().float(), x.grad.float(), probs.grad.float(), grad


def weight_grads(seq: Any, ours: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    pairs = []
    for e, expert in enumerate(seq.local_experts):
        pairs.append((f"fc1[{e}]", expert.linear_fc1.weight.grad.t().float(), ours.weight1.grad[e].float()))
        pairs.append((f"fc2[{e}]", expert.linear_fc2.weight.grad.t().float(), ours.weight2.grad[e].float()))
    return pairs


def bf16_close(name: str, expected: torch.Tensor, actual: torch.Tensor) -> None:
    """bf16 tolerance: differences from accumulation order, relative to the tensor's scale."""
    assert expected.shape == actual.shape, (name, expected.shape, actual.shape)
    if not expected.numel():
        return
    scale = max(expected.abs().max().item(), 1e-6)
    worst = (expected - actual).abs().max().item()
    assert worst <= 2e-2 * scale, f"{name}: max abs diff {worst:.3g} vs scale {scale:.3g}"


def compare(gated: bool, counts: list[int], shift: int = 0) -> None:
    config = make_config(gated)
    seq, ours = sequential(config, 1), grouped(config, 2)
    copy_weights(seq, ours, shift)
    expected, ours_out = run(seq, counts, 3), run(ours, counts, 3)
    for name, a, b in zip(("output", "input grad", "probs grad"), expected[:3], ours_out[:3], strict=True):
        bf16_close(name, a, b)
    for name, a, b in weight_grads(seq, ours):
        bf16_close(name, a, b)


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_matches_sequential_mlp(megatron_single_rank: None, gated: bool, routing: str) -> None:
    compare(gated, ROUTINGS[routing])


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_a_wrong_expert_mapping_is_caught(megatron_single_rank: None, gated: bool) -> None:
    with pytest.raises(AssertionError, match="max abs diff"):
        compare(gated, ROUTINGS["zero-expert"], shift=1)


def test_initialization_and_parameter_tags_match_sequential_mlp(megatron_single_rank: None) -> None:
    config = make_config(gated=True)
    seq, ours = sequential(config, 7), grouped(config, 7)
    for e, expert in enumerate(seq.local_experts):  # same seed, same draws: identical weights
        assert torch.equal(ours.weight1[e], expert.linear_fc1.weight.t())
        assert torch.equal(ours.weight2[e], expert.linear_fc2.weight.t())
    assert ours.weight1.shape == (EXPERTS, HIDDEN, 2 * FFN) and ours.weight1.dtype == torch.bfloat16
    for param in (ours.weight1, ours.weight2):
        assert param.allreduce == seq.local_experts[0].linear_fc1.weight.allreduce  # EP1: True in both
        assert param.tensor_model_parallel is True


def test_probs_on_input_and_unsupported_configs(megatron_single_rank: None) -> None:
    config = make_config(gated=False, moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True)
    seq, ours = sequential(config, 1), grouped(config, 1)
    copy_weights(seq, ours)
    for name, a, b in zip(("output", "input grad", "probs grad"), run(seq, [5, 7, 0, 4], 1)[:3],
                          run(ours, [5, 7, 0, 4], 1)[:3], strict=True):
        bf16_close(name, a, b)
    assert experts_grouped.unsupported_reason(make_config(gated=False)) is None
    assert "bias" in experts_grouped.unsupported_reason(_with(add_bias_linear=True))
    assert "expert tensor parallel size 2" in experts_grouped.unsupported_reason(_with(expert_tensor_parallel_size=2))
    assert "multiples of 8" in experts_grouped.unsupported_reason(_with(moe_ffn_hidden_size=100))
    with pytest.raises(ValueError, match="bias"):
        experts_grouped.experts_class()(EXPERTS, _with(add_bias_linear=True))


def _with(**changes: Any) -> Any:
    config = make_config(gated=False)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


class _Group:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Groups:
    """EP rank 1 of 2, expert data-parallel rank 3: what the module reads of megatron's process groups."""

    ep, expt_tp, expt_dp = _Group(1, 2), _Group(0, 1), _Group(3, 4)


def test_sharded_state_dict_offsets_and_replicas(megatron_single_rank: None) -> None:
    ours = experts_grouped.experts_class()(2, make_config(gated=False), pg_collection=_Groups())
    state = ours.sharded_state_dict("decoder.layers.5.mlp.experts.", sharded_offsets=((0, 5, 12),))
    assert set(state) == {"decoder.layers.5.mlp.experts.weight1", "decoder.layers.5.mlp.experts.weight2"}
    for name, (inner, outer) in (("weight1", (HIDDEN, FFN)), ("weight2", (FFN, HIDDEN))):
        sh = state[f"decoder.layers.5.mlp.experts.{name}"]
        assert sh.data is getattr(ours, name)  # the parameter itself: the distributed optimizer maps onto it
        assert sh.global_shape == (12, 4, inner, outer)  # 2 local experts x EP 2 = 4 global
        assert sh.global_offset == (5, 2, 0, 0)  # this EP rank's experts start at 2
        assert sh.replica_id == (0, 0, 3)  # not the main replica: expert-DP rank 3 does not write it


def _validate_ep2(rank: int, port: int, out: str) -> None:
    """One of 4 gloo ranks, EP 2 x expert data-parallel 2: megatron's own sharding validation (main replicas
    cover each global tensor exactly once), then the same with every replica claiming to be the main one."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=4)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    ours = experts_grouped.experts_class()(EXPERTS // 2, make_config(gated=True))
    state = ours.sharded_state_dict("decoder.layers.0.mlp.experts.")
    _, shards = determine_global_metadata(state)
    validate_sharding_integrity(shards)
    for sh in state.values():
        sh.replica_id = (0, 0, 0)
    _, shards = determine_global_metadata(state)
    try:
        validate_sharding_integrity(shards)
        broken_rejected = False
    except CheckpointingException:
        broken_rejected = True
    if rank == 0:
        main = sorted((sh.key, sh.global_offset) for rank_shards in shards for sh in rank_shards)
        Path(out).write_text(json.dumps({"broken_rejected": broken_rejected, "main": main}))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_sharding_with_ep2_and_expert_data_parallel_2_is_valid(tmp_path: Any) -> None:
    result = tmp_path / "result.json"
    torch.multiprocessing.spawn(_validate_ep2, args=(_free_port(), str(result)), nprocs=4, join=True)
    got = json.loads(result.read_text())
    assert got["broken_rejected"] is True  # megatron's validation does catch a wrong replica id
    offsets = {tuple(offset) for key, offset in got["main"] if key.endswith("weight1")}
    assert offsets == {(0, 0, 0), (2, 0, 0)}  # EP rank 0 holds experts 0-1, EP rank 1 experts 2-3


@pytest.mark.parametrize("choice", ["grouped_mm", "sequential"])
def test_engine_layer_spec_switch(megatron_single_rank: None, choice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine_megatron
    import rope
    from megatron.core.transformer.transformer_config import TransformerConfig

    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import Layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    cfg = workload_config(load_model("tiny-moe"), Layout(mbs=2), RenderOptions(run_id="t", seq_length=32,
                          global_batch_size=2), engine="megatron", world=1, peak_tflops=None)
    assert cfg["parallel"]["experts"] == "grouped_mm"  # rendered default with ETP 1
    cfg["parallel"]["experts"] = choice
    kwargs = engine_megatron.transformer_config_kwargs(cfg) | {
        "bf16": False, "params_dtype": torch.float32, "pipeline_dtype": torch.float32,
        "use_cpu_initialization": True, "moe_token_dispatcher_type": "allgather",
        "moe_shared_expert_overlap": False}
    rope.prepare(kwargs)  # as the engine's build() does
    gpt = engine_megatron.build_model(cfg, TransformerConfig(**kwargs))
    kinds = [type(m).__name__ for m in gpt.modules() if type(m).__name__ in ("GroupedMMExperts", "SequentialMLP")]
    assert kinds == ["GroupedMMExperts" if choice == "grouped_mm" else "SequentialMLP"] * 3  # layers 1-3 are MoE
    tokens = markov_tokens(markov_table(cfg["model"]["vocab_size"], 1), 1, 1, 0, 0, 2, 33)
    loss = gpt(tokens[:, :-1], torch.arange(32).unsqueeze(0).expand(2, -1), None, labels=tokens[:, 1:]).mean()
    loss.backward()
    experts = [m for m in gpt.modules() if type(m).__name__ == kinds[0]]
    grads = [p.grad for m in experts for p in m.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_compiled_elementwise_matches_eager(megatron_single_rank: None, gated: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile of the activation-and-scaling step (inductor: C++ on CPU, triton on GPU) against eager."""
    config = make_config(gated)
    eager = grouped(config, 5)
    monkeypatch.setattr(experts_grouped, "ELEMENTWISE", "compile")
    fused = grouped(config, 5)
    counts = ROUTINGS["zero-expert"]
    for name, a, b in zip(("output", "input grad", "probs grad"), run(eager, counts, 4)[:3],
                          run(fused, counts, 4)[:3], strict=True):
        bf16_close(name, a, b)
    assert fused.elementwise.mode == "compile"  # it did compile (no silent fallback to eager)
    bf16_close("fc1 grad", eager.weight1.grad.float(), fused.weight1.grad.float())
    bf16_close("fc2 grad", eager.weight2.grad.float(), fused.weight2.grad.float())


def test_clamped_swiglu_backward_matches_autograd() -> None:
    """The hand-written backward of Step-3.5-Flash's clamped SwiGLU (what the compiled path runs on the GPU)
    against autograd of its forward, fp32, with activations on both sides of the limit."""
    limit = 0.5
    elementwise = experts_grouped.Elementwise(True, "eager", limit)
    torch.manual_seed(0)
    fc1 = (torch.randn(64, 2 * FFN) * 2).requires_grad_()
    probs = torch.rand(64).requires_grad_()
    grad = torch.randn(64, FFN)
    out = elementwise.forward_fn(fc1, probs)
    gate, up = fc1.detach().chunk(2, dim=-1)
    assert (F.silu(gate) > limit).any() and (up.abs() > limit).any()  # the clamps bind somewhere
    want_fc1, want_probs = torch.autograd.grad(out, (fc1, probs), grad)
    got_fc1, got_probs, again = elementwise.backward_fn(fc1.detach(), probs.detach(), grad)
    torch.testing.assert_close(got_fc1, want_fc1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_probs, want_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again, out.detach(), rtol=1e-6, atol=1e-7)
    unclamped = experts_grouped.Elementwise(True, "eager").forward_fn(fc1.detach(), probs.detach())
    assert (unclamped - out.detach()).abs().max() > 0.1  # the limit is applied
    with pytest.raises(ValueError, match="needs a gated"):
        experts_grouped.Elementwise(False, "eager", limit)
    assert experts_grouped.with_swiglu_limit(7.0).swiglu_limit == 7.0
    assert experts_grouped.with_swiglu_limit(None) is experts_grouped.experts_class()
