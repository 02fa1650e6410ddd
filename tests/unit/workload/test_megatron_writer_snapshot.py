"""The persistent writer gets copies of the host tensors it writes (megatron_writer.snapshot_host_tensors): its
worker's host copy of a tensor already in host memory is the tensor itself, which the next step would change while
it is written (a resumed CPU run diverged at its second step: test_megatron_layouts.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron_writer import snapshot_host_tensors  # noqa: E402  (conftest.py puts the workload directory on sys.path)


def test_host_tensors_are_copied_and_the_originals_left_to_train_on() -> None:
    weight, moment = torch.arange(6.0), torch.ones(3)
    state = {"model": {"w": ShardedTensor.from_rank_offsets("w", weight)},
             "optimizer": [{"exp_avg": ShardedTensor.from_rank_offsets("m", moment)}], "step": 7}
    assert snapshot_host_tensors(state) == 2
    saved_w, saved_m = state["model"]["w"].data, state["optimizer"][0]["exp_avg"].data
    assert saved_w.data_ptr() != weight.data_ptr() and saved_m.data_ptr() != moment.data_ptr()
    weight.add_(100.0)  # the next optimizer step, in place
    moment.mul_(0.0)
    assert saved_w.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and saved_m.tolist() == [1.0, 1.0, 1.0]
    assert state["step"] == 7
