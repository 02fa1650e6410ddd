"""Step-3.5-Flash in the megatron engine against an independent fp32 reference (step35_reference.py: plain torch,
written from the Hugging Face config and modeling_step3p5.py's semantics), with the same weights, on CPU
(megatron-core 0.16.1 here; the H200 runs 0.19.2). One layer of each kind -- full attention with a dense FFN,
sliding window with MoE, sliding window with MoE and clamped SwiGLUs -- and one MTP layer: outputs and every
gradient (the input's and each weight's) agree to fp32 rounding. Each reference feature switched off in turn
(the head gate, the window and its edge, the layer's own RoPE and its llama3 scaling, the (1 + w) norms, q/k
norms, the router bias, top-k renormalisation, the shared expert, the clamps, MTP's concatenation order) moves
the output far beyond that, so a feature the engine lacked would fail the comparison. The main model's per-token
loss matches end to end, the built model has exactly the planner's parameters, and megatron's
finalize_model_grads moves the router bias by bias_update_rate towards balance (the auxiliary-loss-free scheme).

It runs in a child process because making megatron-core run on CPU means repointing torch's CUDA calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
torch = pytest.importorskip("torch")
if not hasattr(torch, "_grouped_mm"):
    pytest.skip("torch without torch._grouped_mm", allow_module_level=True)

AGREE = 5e-6  # relative to the largest magnitude; fp32 reorderings measured at most 6e-7
DIFFER = 1e-4  # a switched-off feature: the smallest measured effect was 1.6e-4 (20x above AGREE's bound)


@pytest.fixture(scope="module")
def result() -> dict:
    script = Path(__file__).with_name("megatron_cpu_step35.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kind_of_layer_matches_the_reference_output_and_gradients(result: dict) -> None:
    kinds = {case["kind"]: case for case in result["cases"]}
    assert set(kinds) == {"full/dense", "sliding/moe", "sliding/moe clamped", "mtp"}
    for case in result["cases"]:
        assert case["output"] < AGREE, case
        assert case["grad_max"] < AGREE, case
        assert case["grads"] >= 13, case  # the input's and every weight's


def test_each_feature_switched_off_in_the_reference_breaks_the_match(result: dict) -> None:
    switched = {(case["kind"], name): diff for case in result["cases"] for name, diff in case["switched_off"].items()}
    assert len(switched) == 23
    assert {name for _kind, name in switched} == {
        "head_gate", "window", "window_edge", "layer_rope", "llama3", "zero_centered", "qk_norm", "router_bias",
        "renormalise", "shared_expert", "clamp", "mtp_concat_embedding_first"}
    quiet = {key: diff for key, diff in switched.items() if diff < DIFFER}
    assert not quiet, quiet


def test_the_whole_main_model_matches_and_has_the_planners_parameters(result: dict) -> None:
    assert result["model_loss"] < AGREE
    assert result["params"] == result["planner_params"]


def test_the_slices_and_the_full_model_built_by_the_engine_have_the_planners_parameters(result: dict) -> None:
    counts = result["catalog_params"]
    assert counts["step-3.5-flash"] == [197_800_415_232, 197_800_415_232]  # the HF checkpoint's unique weights
    for name in ("step-3.5-flash-slice-1gpu", "step-3.5-flash-slice-ep2"):
        built, planned = counts[name]
        assert built == planned, name
    assert counts["step-3.5-flash-slice-1gpu"][0] == 3_437_421_824


def test_expert_parallel_2_on_two_ranks_matches_the_reference_with_every_expert(tmp_path: Path) -> None:
    """As step-3.5-flash-slice-ep2 runs on two GPUs: two experts of four per rank, all-to-all routing across
    the ranks (megatron's allgather dispatcher here), the same loss as the reference with all four experts."""
    script = Path(__file__).with_name("megatron_cpu_step35_ep2.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ep2.json")], capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["local_experts"] == [2, 2, 2], r  # 4 experts over EP 2, in each of the 3 MoE layers
        assert r["loss_vs_reference"] < AGREE, r
        assert r["bias_rank0"] == r["bias_rank1"], r  # the loads are all-reduced: one bias on every rank
        assert r["bias_moved"] == pytest.approx(1e-3, rel=1e-4), r


def test_the_router_bias_moves_towards_balance_after_a_step(result: dict) -> None:
    before, after, loads = result["bias_before"], result["bias_after"], result["loads"]
    mean = sum(loads) / len(loads)
    rate = result["bias_update_rate"]
    assert len(loads) == 4 and sum(loads) > 0
    for b0, b1, load in zip(before, after, loads, strict=True):
        direction = (mean > load) - (mean < load)  # under-loaded experts gain, over-loaded ones lose
        assert b1 - b0 == pytest.approx(rate * direction, abs=1e-7)


def test_router_stats_count_what_megatron_counts_and_read_the_bias(result: dict) -> None:
    """The engine's per-layer load (hooks on megatron's routers) agrees with megatron's own expert-bias counter
    for the layer, counts only passes with gradients, reads the moved bias, and clears itself for the next step."""
    stats, loads = result["router_stats"], result["loads"]
    summary = stats["summary"]
    assert stats["hooked"] == 3  # layers 2 to 4 route (layer 1 and the MTP layer are dense)
    assert set(summary["moe_load"]) == {"2", "3", "4"}
    assert stats["counted"] == loads  # the no-grad forward before the step is not counted
    expected = max(loads) * len(loads) / sum(loads)
    assert summary["moe_load"]["2"] == pytest.approx(expected, abs=1e-4)
    assert summary["moe_load_max"] == max(summary["moe_load"].values()) and summary["moe_dropped"] == 0.0
    moved = max(abs(b1) for b1 in result["bias_after"])
    assert summary["router_bias"]["2"] == pytest.approx(moved, rel=1e-5) and moved > 0
    assert stats["counts_after_reduce"] == 0


def test_mtp_loss_is_read_from_megatrons_tracker(result: dict) -> None:
    assert len(result["mtp_loss"]) == 1 and 0.0 < result["mtp_loss"][0] < 10.0, result["mtp_loss"]
