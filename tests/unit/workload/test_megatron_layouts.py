"""The megatron engine runs what the planner offers: interleaved virtual pipelines, uneven first/last pipeline
stages and the optimizer on the host (plan/engines.py, data/engines.yaml), trained on 2 CPU ranks (gloo) with
megatron-core's own schedules and optimizers (megatron_cpu_layouts.py, a process of its own: making megatron-core
run on the CPU repoints torch's CUDA calls), and saved and resumed with the engine's checkpoints
(megatron_cpu_layout_resume.py). The step time and memory of VPP and offload are measured on GPUs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")


def _two_ranks(script: str, out: Path) -> dict[str, Any]:
    """Run `script` (2 gloo ranks, a process of its own) -> {run name: every rank's report}."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), str(out)], capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {run["name"]: run["ranks"] for run in json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _two_ranks("megatron_cpu_layouts.py", tmp_path_factory.mktemp("layouts") / "result.json")


def _last_stage_losses(ranks: list[dict[str, Any]]) -> list[float]:
    losses = [rank["losses"] for rank in ranks if rank["losses"][0] is not None]
    assert len(losses) == 1, ranks  # only the last pipeline stage has the loss
    return losses[0]


def test_interleaved_pipeline_holds_two_chunks_per_rank_and_learns(runs: dict[str, Any]) -> None:
    ranks = runs["vpp"]
    # 4 layers, PP 2 x VPP 2: rank 0 holds layers 1 and 3, rank 1 layers 2 and 4 (megatron's interleaving)
    assert [rank["chunk_layers"] for rank in ranks] == [[[1], [3]], [[2], [4]]]
    losses = _last_stage_losses(ranks)
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(all(rank["fused_groups"]) for rank in ranks)  # optimizer=fused reached torch's AdamW


def test_interleaved_pipeline_runs_micro_batches_pp_does_not_divide(runs: dict[str, Any]) -> None:
    ranks = runs["vpp-group"]
    assert {(rank["micro_batches"], rank["vpp_group"]) for rank in ranks} == {(3, 3)}
    losses = _last_stage_losses(ranks)
    assert losses[-1] < losses[0] - 0.5, losses


def test_uneven_split_is_the_planners(runs: dict[str, Any]) -> None:
    ranks = runs["uneven"]
    assert ranks[0]["stage_layers"] == [2, 3]  # rendered as megatron's first/last stage sizes
    assert [rank["chunk_layers"] for rank in ranks] == [[[1, 2]], [[3, 4, 5]]]
    losses = _last_stage_losses(ranks)
    assert losses[-1] < losses[0] - 0.5, losses
    assert not any(any(rank["fused_groups"]) for rank in ranks)  # foreach, the default


def test_offloaded_optimizer_steps_on_the_host_and_trains_as_the_device_one(runs: dict[str, Any]) -> None:
    for rank in runs["offload"]:
        assert rank["optimizers"] == ["HybridDeviceOptimizer"]
        offloaded = rank["offloaded"]
        assert offloaded["device_optimizers"] == 0 and offloaded["host_params"] == offloaded["params"] > 0
    for device, host in zip(runs["on-device"], runs["offload"], strict=True):
        assert device["losses"][0] == host["losses"][0]  # same weights, same data
        assert host["losses"][-1] < host["losses"][0] - 0.5, host["losses"]
        for a, b in zip(device["losses"], host["losses"], strict=True):
            assert math.isclose(a, b, rel_tol=1e-3), (device["losses"], host["losses"])  # measured: 6e-5


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("psutil", reason="dist-checkpointing's writer needs psutil")
    return _two_ranks("megatron_cpu_layout_resume.py", tmp_path_factory.mktemp("layout-resume") / "result.json")


@pytest.mark.parametrize("layout", ["vpp", "offload"])
def test_a_resumed_layout_continues_exactly_as_the_uninterrupted_run(resumed: dict[str, Any], layout: str) -> None:
    """Saved asynchronously after 2 steps (the uninterrupted run takes 2 more while it is written), resumed into a
    model and optimizer from another seed: the same 2 steps, the same losses and weights, bit for bit (CPU)."""
    for rank in resumed[layout]:
        assert "error" not in rank, rank.get("traceback")
        assert rank["resumed"] == 2 and rank["committed"] == ["iter_0000002", "latest"], rank
        assert rank["params_differing_before"] > 0, rank  # the load must move the second model's weights
        assert rank["losses_resumed"] == rank["losses_continued"], rank
        assert rank["params_differing_after"] == 0, rank
        saved, resumed_master = rank["master_weights"]
        assert saved == resumed_master > 0 and rank["master_differing_after"] == 0, rank
