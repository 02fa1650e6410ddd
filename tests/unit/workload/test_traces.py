"""The megatron engine's diagnostics: the profile window, kernel categories, and where an iteration's time goes."""

from __future__ import annotations

import json
from pathlib import Path

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
