"""The megatron engine's ParamGather (the overlapped param all-gather dispatched whole after the optimizer step)
against megatron-core's own dispatch from the forward's pre-hooks, with expert parallelism: 4 CPU ranks (gloo),
EP 2. A child process, because making megatron-core run on CPU means repointing torch's CUDA calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")


def test_param_gather_after_the_step_trains_exactly_as_megatrons_with_expert_parallel_buckets(tmp_path: Path) -> None:
    script = Path(__file__).with_name("megatron_cpu_param_gather.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "result.json")], capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["overlap_param_gather"] and result["average_in_collective"], result  # the engine's DDP config
    dense, expert = result["dense_groups"], result["expert_groups"]
    assert dense > 1 and expert > 1, result  # buckets over DP 4 and over the expert data-parallel group of 2
    assert result["eager_losses"] == result["lazy_losses"], result
    assert result["params_differing_on_any_rank"] == 0, result
    assert result["params_trained_on_all_ranks"] == 4 * result["params"], result  # every weight moved on every rank
    # megatron's pre-hooks dispatch every group each step; with ParamGather only in the first forward (nothing
    # was dispatched before it), then never: both kinds of bucket go out after the step. The last entry is the
    # synchronous gather before a save.
    groups = dense + expert
    assert result["dispatched_by_megatron_per_step"] == {"lazy": [groups] * 4, "eager": [groups, 0, 0, groups]}
