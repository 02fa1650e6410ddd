"""rope.py's fused RoPE against megatron-core's own unfused RoPE (0.16.1, on CPU): the same formula (outputs and
gradients bit for bit where both run eagerly, full and partial rotary, fp32 and bf16), the plug-in point
(TransformerConfig refuses apply_rope_fusion without a kernel and accepts it once rope.py is installed; TE's kernel,
where present, is left alone), megatron's fused path calling it inside a GPTModel with the same result as the
unfused path, and the formula compiled whole (one graph, no break) by torch.compile, as it runs on a GPU."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
import rope  # noqa: E402  (tests/unit/workload/conftest.py puts the workload directory on sys.path)
from megatron.core.models.common.embeddings import rope_utils  # noqa: E402

from tests.unit.workload.compiled_check import assert_compiled_matches_eager  # noqa: E402

SEQ, BATCH, HEADS, HEAD_DIM = 12, 2, 3, 16


def angles(rot_dim: int, seq: int = SEQ) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


@pytest.fixture
def no_te_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's module as on a node without TransformerEngine; whatever install() puts there is undone after."""
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [HEAD_DIM, HEAD_DIM // 2])
def test_the_formula_is_megatrons_unfused_one_bit_for_bit(dtype: torch.dtype, rot_dim: int) -> None:
    torch.manual_seed(0)
    t = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, dtype=dtype)
    grad = torch.randn_like(t)
    freqs = angles(rot_dim)
    ours_in, theirs_in = t.clone().requires_grad_(), t.clone().requires_grad_()
    ours = rope.fused_apply_rotary_pos_emb(ours_in, freqs)
    theirs = rope_utils._apply_rotary_pos_emb_bshd(theirs_in, freqs)
    assert ours.dtype == dtype and torch.equal(ours, theirs)
    if rot_dim < HEAD_DIM:  # the unrotated dims pass through untouched
        assert torch.equal(ours[..., rot_dim:], t[..., rot_dim:])
    assert not torch.equal(ours[..., :rot_dim], t[..., :rot_dim])
    ours.backward(grad)
    theirs.backward(grad)
    assert torch.equal(ours_in.grad, theirs_in.grad)


def test_interleaved_rotary_is_refused_not_computed_wrongly() -> None:
    with pytest.raises(ValueError, match="rotate-half only"):
        rope.fused_apply_rotary_pos_emb(torch.zeros(SEQ, 1, 1, HEAD_DIM), angles(HEAD_DIM), interleaved=True)


def config_kwargs(**extra: Any) -> dict[str, Any]:
    return {"num_layers": 1, "hidden_size": HEADS * HEAD_DIM, "num_attention_heads": HEADS,
            "use_cpu_initialization": True} | extra


def test_transformer_config_takes_the_flag_only_once_a_kernel_is_installed(no_te_kernel: None) -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        TransformerConfig(**config_kwargs(apply_rope_fusion=True))
    assert rope.prepare(config_kwargs()) is None  # not asked for: nothing installed
    assert rope_utils.fused_apply_rotary_pos_emb is None
    assert rope.prepare(config_kwargs(apply_rope_fusion=True)) == "RoPE fusion: rope.py's compiled kernel"
    assert rope_utils.fused_apply_rotary_pos_emb is rope.fused_apply_rotary_pos_emb
    assert TransformerConfig(**config_kwargs(apply_rope_fusion=True)).apply_rope_fusion
    assert rope.install()  # again: still ours


def test_transformer_engines_kernel_where_present_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    def te_kernel(t: torch.Tensor, freqs: torch.Tensor, **_kw: Any) -> torch.Tensor:
        return t

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", te_kernel)
    assert rope.prepare(config_kwargs(apply_rope_fusion=True)) == "RoPE fusion: TransformerEngine's kernel"
    assert rope_utils.fused_apply_rotary_pos_emb is te_kernel


def test_megatrons_fused_path_in_the_engines_model_gives_the_unfused_result(
        megatron_single_rank: None, no_te_kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine_megatron
    from megatron.core.transformer.transformer_config import TransformerConfig

    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import Layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # RoPE's frequencies stay on the CPU
    cfg = workload_config(load_model("tiny-dense"), Layout(mbs=BATCH),
                          RenderOptions(run_id="t", seq_length=SEQ, global_batch_size=BATCH), engine="megatron",
                          world=1, peak_tflops=790.0)
    calls: list[tuple[int, ...]] = []

    def counted(t: torch.Tensor, freqs: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append(tuple(t.shape))
        return rope.fused_apply_rotary_pos_emb(t, freqs, **kw)

    def run(fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        kwargs = engine_megatron.transformer_config_kwargs(cfg) | {
            "bf16": False, "params_dtype": torch.float32, "pipeline_dtype": torch.float32,
            "use_cpu_initialization": True, "apply_rope_fusion": fused}
        assert (rope.prepare(kwargs) is not None) == fused  # what the engine's build() calls
        if fused:
            monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", counted)
        torch.manual_seed(1)
        model = engine_megatron.build_model(cfg, TransformerConfig(**kwargs))
        tokens = torch.randint(0, cfg["model"]["vocab_size"], (BATCH, SEQ + 1),
                               generator=torch.Generator().manual_seed(2))
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain_loss, plain_grads = run(False)
    assert not calls
    fused_loss, fused_grads = run(True)
    layers = cfg["model"]["num_layers"]
    assert len(calls) == 2 * layers  # q and k of every layer went through megatron's fused entry point
    assert torch.equal(plain_loss, fused_loss)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, fused_grads, strict=True))


@pytest.mark.parametrize("rot_dim", [HEAD_DIM, HEAD_DIM // 2])
def test_the_formula_compiles_to_one_graph_and_matches_eager(rot_dim: int) -> None:
    """As on a GPU: one compiled function for every kind of layer (the slice's full and sliding layers differ in head
    count and rotated width; q and k in head count), default dynamic shapes, each shape matching eager."""
    pytest.importorskip("torch._inductor")
    torch._dynamo.reset()
    compiled = torch.compile(rope.rope_bshd, fullgraph=True)  # a graph break would raise here
    freqs = angles(rot_dim)
    for heads in (HEADS, 2 * HEADS, 1):
        t = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=torch.Generator().manual_seed(heads))
        assert_compiled_matches_eager(compiled, rope.rope_bshd, t, freqs)


def test_a_failing_compiler_falls_back_to_eager_once_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    compiled_calls: list[int] = []

    def broken_compiler(fn: Any) -> Any:
        def run(*args: Any) -> Any:
            compiled_calls.append(1)
            raise RuntimeError("no triton")
        return run

    kernel = rope.CompiledOrEager(rope.rope_bshd, "rope.py", compiler=broken_compiler)
    t, freqs = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM), angles(HEAD_DIM)
    assert torch.equal(kernel(t, freqs), rope.rope_bshd(t, freqs))
    assert torch.equal(kernel(t, freqs), rope.rope_bshd(t, freqs))
    assert kernel.failed and len(compiled_calls) == 1  # not tried again
    said = capsys.readouterr().out
    assert said.count("torch.compile failed (RuntimeError: no triton); eager from now on") == 1
    working = rope.CompiledOrEager(rope.rope_bshd, "rope.py", compiler=lambda fn: (lambda *a: fn(*a) * 2))
    assert torch.equal(working(t, freqs), 2 * rope.rope_bshd(t, freqs)) and not working.failed
    with pytest.raises(RuntimeError):  # the inputs' own error is not hidden by the eager retry
        kernel(torch.randn(SEQ, BATCH, HEADS, HEAD_DIM), angles(HEAD_DIM, seq=SEQ + 1))
