"""The megatron engine's checkpoint round trip with megatron-core's real DistributedOptimizer and
dist-checkpointing, on CPU (megatron-core 0.16.1 here; 0.19.2 on the H200 machine: docs/benchmarks.md).

It runs in a child process because making megatron-core run on CPU means repointing torch's CUDA calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
pytest.importorskip("psutil", reason="dist-checkpointing's writer needs psutil")


@pytest.mark.parametrize("model", ["tiny-moe"])
def test_resume_restores_the_state_and_continues_exactly_as_the_uninterrupted_run(model: str, tmp_path: Path) -> None:
    script = Path(__file__).with_name("megatron_cpu_checkpoint.py")
    proc = subprocess.run([sys.executable, str(script), model, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["resumed"] == 2
    # the save went on in the background (a forked writer); the step loop took two steps before the commit
    assert result["in_flight_after_save"] is True
    save, committed = (p for p in result["phases"] if p["phase"] in ("save", "save_committed"))
    assert save["phase"] == "save" and save["background"] is True and save["iteration"] == 2
    assert committed["phase"] == "save_committed" and committed["iteration"] == 2 and committed["time"] > save["time"]
    assert "complete" in result["checkpoint_files"] and "stepdeploy.json" in result["checkpoint_files"]
    # the resumed model was built without random initialization (the checkpoint's load fills every weight)
    assert result["initialization_skipped"] == [[2, True]]
    parts = result["load_parts"]
    assert set(parts) == {"find", "optimizer_state", "state_dict", "read", "apply", "direct_gb", "host_gb",
                          "direct_items", "other_tensors", "objects", "read_gbps", "locate_s", "copy_s"}
    assert parts["host_gb"] == 0  # resumed without a host copy: everything from storage
    # the host copy (host_copy.py): the Saver copied each committed checkpoint, the older copy went with its
    # checkpoint; a restore of 4 read every data file from it, and got the weights checkpoint 4 holds
    assert result["host_copies"] == ["iter_0000004"] and result["host_resumed"] == 4
    assert result["host_left_after_the_end"] is False  # the end of training gives the memory back
    assert result["host_parts"]["host_gb"] == result["host_parts"]["direct_gb"] > 0, result["host_parts"]
    assert result["host_params_differing"] == 0
    # the read straight from the files (ckpt_read.py) took every tensor: weights, fp32 master weights, Adam state;
    # torch's reader only the pickled objects (the layers' extra state, the optimizer's parameter groups)
    assert parts["direct_items"] >= result["params"] * 4 and parts["direct_gb"] > 0, parts
    assert parts["other_tensors"] == 0 and parts["objects"] > 0, parts
    # retention 1: 2 stays until 4 is committed, then goes
    assert result["before_second_commit"] == ["iter_0000002", "latest"]
    assert result["after_second_commit"] == ["iter_0000004", "latest"] and result["latest"] == "4"
    assert result["params_differing_before"] > 0  # the second model starts elsewhere: the load must move it
    assert result["params_differing"] == 0, result
    saved, resumed = result["adam_states"]
    assert saved == resumed > 0
    assert result["adam_tensors_differing"] == 0, result
    # Adam's bias correction needs the step: megatron's load would leave the fresh optimizer's 1
    assert result["steps_saved"] == result["steps_resumed"] == [2.0], result
    saved_main, resumed_main = result["main_params"]
    assert saved_main == resumed_main > 0 and result["main_params_differing"] == 0, result
    # the resumed run continues exactly as the uninterrupted one (CPU, one rank: deterministic). Before each
    # parameter got a step tensor of its own, the second step differed: one shared tensor counted every parameter
    assert result["losses_resumed"] == result["losses_continued"], result
    assert result["params_differing_after_2_steps"] == 0, result
    # the engine's param gather, dispatched whole after each step: the same training as megatron's pre-hooks
    groups = result["eager_gather_groups"]
    assert groups > 1 and result["eager_first_group_has_embedding"], result  # forward order: embedding first
    # the first forward dispatches each bucket from its pre-hook (nothing was dispatched before it), then only
    # the engine dispatches: megatron's pre-hooks just wait
    assert result["eager_dispatched_per_step"] == [2 * groups, groups, groups, groups], result
    assert result["eager_redispatch_warnings"] == 0, result  # the pre-hooks know the gather is dispatched
    assert result["eager_losses"] == result["lazy_losses"], result
    assert result["eager_params_differing"] == 0, result


def test_an_asynchronous_save_on_two_ranks_commits_only_whole_and_an_abort_commits_nothing(tmp_path: Path) -> None:
    """DP 2 with the distributed optimizer: each rank writes its own optimizer shard in a forked writer; rank 0
    commits once both ranks' writes ended. A save aborted while it is written (a stop) leaves checkpoint 1 as
    `latest`, and the abort removes what it left (issue 36: no staging directory outlives a stop)."""
    script = Path(__file__).with_name("megatron_cpu_checkpoint_dp2.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    for result in ranks:
        assert result["committed_1"] == ["iter_0000001", "latest"], result
        assert result["latest_after_abort"] == "1", result
        assert result["after_abort"] == ["iter_0000001", "latest"], result
        assert result["resumed"] == 1 and result["differing_before"] > 0, result
        assert result["params_differing"] == 0 and result["main_shards"] > 0 and result["main_differing"] == 0, result
        assert result["after_resume"] == ["iter_0000001", "latest"], result
