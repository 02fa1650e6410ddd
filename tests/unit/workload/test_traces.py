"""The megatron engine's diagnostics: the profile window, kernel categories, and where an iteration's time goes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import traces  # noqa: E402  (tests/unit/workload/conftest.py puts the workload directory on sys.path)


@pytest.mark.parametrize(("text", "window"), [(None, None), ("", None), ("16:17", (16, 17)), ("5", (5, 5)),
                                             ("3:", (3, 3))])
def test_profile_window(text: str | None, window: tuple[int, int] | None) -> None:
    assert traces.parse_window(text) == window


@pytest.mark.parametrize("text", ["a:b", "0:3", "7:6", ":4"])
def test_bad_profile_window_is_refused_with_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="FIRST"):
        traces.parse_window(text)


def test_kernels_fall_into_categories_and_no_compute_time_is_what_is_left() -> None:
    kernels = [
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 40_000.0, 10),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 300_000.0, 200),
        ("void cutlass::device_kernel<grouped_mm>", 200_000.0, 40),
        ("void pytorch_flash::flash_fwd_kernel<...>", 60_000.0, 24),
        ("void at::native::multi_tensor_apply_kernel<Adam...>", 20_000.0, 4),
        ("void at::native::vectorized_elementwise_kernel<gelu>", 80_000.0, 300),
        ("triton_red_fused__to_copy_add_erf_exp_mul_sum_unsqueeze_0", 10_000.0, 24),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", 4_000.0, 8),
    ]
    result = traces.summarize(kernels, wall_s=1.5, iterations=2)
    got = result["gpu_s_by_category"]
    assert got == {"GEMM": 0.15, "grouped GEMM": 0.1, "other": 0.04, "attention": 0.03,
                   "communication (NCCL)": 0.02, "optimizer (Adam)": 0.01, "compiled elementwise (triton)": 0.005,
                   "copies and fills": 0.002}
    assert result["wall_s"] == 0.75
    assert result["compute_s"] == pytest.approx(0.337)  # communication is not compute
    assert result["no_compute_s"] == pytest.approx(0.413)
    assert result["top_kernels"][0]["name"].startswith("nvjet") and result["top_kernels"][0]["calls"] == 200


def test_profile_covers_exactly_the_window_and_writes_its_summary(tmp_path: Path) -> None:
    profile = traces.StepProfile(tmp_path, 3, "2:3")
    flags = []
    for iteration in range(1, 5):
        profile.before(iteration)
        torch.randn(64, 64) @ torch.randn(64, 64)
        flags.append(profile.after(iteration, 0.25))
    assert flags == [False, True, True, False]
    result = json.loads((tmp_path / "profile-rank3.json").read_text())
    assert result["window"] == [2, 3] and result["iterations"] == 2 and result["wall_s"] == 0.25
    assert any("mm" in k["name"] for k in result["top_kernels"])  # CPU operators' time without a GPU


def test_no_profile_unless_asked(tmp_path: Path) -> None:
    profile = traces.StepProfile(tmp_path, 0, None)
    profile.before(1)
    assert profile.after(1, 0.1) is False
    assert not list(tmp_path.iterdir())


def test_idle_gaps_are_the_holes_between_compute_kernels_and_nccl_does_not_fill_them() -> None:
    kernels = [
        (0.0, 1_000.0, "nvjet_gemm_a"),
        (200.0, 1_200.0, "elementwise_b"),  # overlaps a: the interval runs to 1,200
        (1_250.0, 2_000.0, "nvjet_gemm_c"),  # 50 us hole: under min_us
        (2_000.0, 9_000.0, "ncclDevKernel_AllGather_RING_LL"),  # exposed all-gather: no compute beside it
        (9_000.0, 9_500.0, "multi_tensor_apply_kernel<Adam>"),
        (12_500.0, 13_000.0, "nvjet_gemm_d"),
    ]
    result = traces.idle_gaps(kernels, top=1)
    assert result["count"] == 2 and result["total_ms"] == 10.0
    assert result["largest"] == [{"at_ms": 2.0, "ms": 7.0, "after": "nvjet_gemm_c",
                                  "before": "multi_tensor_apply_kernel<Adam>"}]
    assert traces.idle_gaps([]) == {"total_ms": 0.0, "count": 0, "min_us": 100.0, "largest": []}


def test_the_first_step_of_a_start_is_profiled_on_the_host_only_when_asked(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """STEPDEPLOY_PROFILE_FIRST=1: the first step after this start (a resume: start + 1) runs under cProfile; its
    import of a module nobody loaded yet shows under `imports`, and nothing else is profiled."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "first_step_probe_mod.py").write_text("import time\ntime.sleep(0.2)\nVALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    traces.StepProfile(tmp_path, 0, None, first_step=11).before(11)  # not asked: nothing happens
    assert not list(tmp_path.glob("first-step-*"))
    monkeypatch.setenv("STEPDEPLOY_PROFILE_FIRST", "1")
    profile = traces.StepProfile(tmp_path, 2, None, first_step=11)
    flags = []
    for iteration in (11, 12):
        profile.before(iteration)
        if iteration == 11:
            __import__("first_step_probe_mod")
        flags.append(profile.after(iteration, 0.5))
    assert flags == [True, False]
    result = json.loads((tmp_path / "first-step-rank2-11.json").read_text())
    assert result["iteration"] == 11 and result["step_s"] == 0.5
    assert 0.15 < result["categories"]["imports"] < 5  # the module's import, counted once though nested
    assert any("sleep" in row[0] for row in result["by_own_time"][:3])
    assert result["categories"]["megatron-core"] == 0


def test_host_categories_count_a_category_s_outermost_functions_once() -> None:
    dynamo_outer, dynamo_inner, other = ("/x/torch/_dynamo/eval_frame.py", 10, "_fn"), \
        ("/x/torch/_dynamo/convert_frame.py", 20, "compile"), ("/x/train.py", 5, "step")
    stats = {other: (1, 1, 0.1, 3.0, {}),
             dynamo_outer: (2, 2, 0.2, 2.0, {other: (2, 2, 0.2, 2.0)}),
             dynamo_inner: (1, 1, 1.5, 1.5, {dynamo_outer: (1, 1, 1.5, 1.5)})}
    assert traces.categories(stats)["torch.compile (dynamo, inductor, triton: compiling or loading from its cache)"] \
        == 2.0
    assert traces.top(stats, 2, 1) == [["_dynamo/convert_frame.py:20(compile)", 1.5, 1]]


def test_compile_callers_name_the_model_s_call_sites_of_compiled_functions() -> None:
    """An edge into torch.compile counts where the caller is the model's code: not torch's own wrappers, not a
    built-in, not torch.compile calling itself."""
    dynamo, inductor = ("/x/torch/_dynamo/eval_frame.py", 10, "_fn"), ("/x/torch/_inductor/utils.py", 3, "run")
    wrapper, builtin = ("/x/torch/_utils_internal.py", 85, "wrapper_function"), ("~", 0, "<built-in method x>")
    loss, mlp = ("/x/megatron/core/fusions/fused_cross_entropy.py", 40, "forward"), ("/w/layers.py", 7, "mlp")
    stats = {dynamo: (3, 3, 0.1, 2.5, {loss: (2, 2, 0.1, 2.0), mlp: (1, 1, 0.0, 0.5), wrapper: (1, 1, 0.0, 0.4)}),
             inductor: (1, 1, 0.2, 1.0, {dynamo: (1, 1, 0.2, 1.0), builtin: (1, 1, 0.0, 0.3)})}
    assert traces.compile_callers(stats) == [["fusions/fused_cross_entropy.py:40(forward)", 2.0, 2],
                                              ["w/layers.py:7(mlp)", 0.5, 1]]


def test_counter_changes_keep_only_what_changed() -> None:
    before = {"inductor": {"fxgraph_cache_hit": 2, "fxgraph_cache_miss": 1}}
    after = {"inductor": {"fxgraph_cache_hit": 5, "fxgraph_cache_miss": 1}, "aot_autograd": {"autograd_cache_miss": 1}}
    assert traces.counter_changes(before, after) == {"aot_autograd/autograd_cache_miss": 1,
                                                     "inductor/fxgraph_cache_hit": 3}


def test_a_first_step_that_compiles_names_the_call_site_and_the_counters(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch.compile'd function first called inside the profiled step (dynamo with the eager backend: no C++
    compiler needed): its call site is in compile_callers, and dynamo's capture in compile_counters."""
    compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="eager")

    def model_forward(x: Any) -> Any:
        return compiled(x)

    monkeypatch.setenv("STEPDEPLOY_PROFILE_FIRST", "1")
    profile = traces.StepProfile(tmp_path, 0, None, first_step=1)
    profile.before(1)
    model_forward(torch.randn(8))
    assert profile.after(1, 0.5) is True
    result = json.loads((tmp_path / "first-step-rank0-1.json").read_text())
    assert result["compile_callers"][0][0].endswith("(model_forward)") and result["compile_callers"][0][1] > 0
    assert result["compile_counters"].get("stats/unique_graphs") == 1
