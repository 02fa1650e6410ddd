"""Reading a checkpoint with several threads (ckpt_read.py, issue 20's restart time): what torch's reader reads,
item for item, and megatron-core's loads going through it inside parallel_reads()."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import ckpt_read  # tests/unit/workload/conftest.py puts the workload directory on sys.path
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException


def _state() -> dict:
    gen = torch.Generator().manual_seed(7)
    state: dict = {f"w{i}": torch.randn(3 + 17 * i, 5, generator=gen) for i in range(12)}
    state["half"] = torch.randn(64, generator=gen).to(torch.bfloat16)
    state["ints"] = torch.arange(40, dtype=torch.int64).reshape(8, 5)
    state["extra"] = io.BytesIO(b"a non-tensor item, read as bytes")
    return state


@pytest.mark.parametrize("threads", [2, 3, 16])
def test_parallel_reader_reads_every_item_into_its_own_tensor(tmp_path: Path, threads: int) -> None:
    saved = _state()
    dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path), thread_count=3), no_dist=True)
    target = {k: torch.zeros_like(v) for k, v in saved.items() if isinstance(v, torch.Tensor)}
    target["extra"] = io.BytesIO()
    reference = {k: torch.zeros_like(v) for k, v in saved.items() if isinstance(v, torch.Tensor)}
    reference["extra"] = io.BytesIO()

    dcp.load(target, storage_reader=ckpt_read.ParallelReader(str(tmp_path), threads), no_dist=True)
    dcp.load(reference, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)

    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(target[key], value), key
            assert torch.equal(reference[key], value), key
    assert target["extra"].getvalue() == b"a non-tensor item, read as bytes"


def test_a_failed_read_is_raised(tmp_path: Path) -> None:
    saved = {"a": torch.ones(4), "b": torch.ones(6)}
    dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path), thread_count=1), no_dist=True)
    target = {"a": torch.zeros(4), "b": torch.zeros(6)}
    for data in tmp_path.glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:10])  # cut short: torch.load fails in a reader thread
    with pytest.raises(CheckpointException, match="zip archive"):  # torch.load's error, from a reader thread
        dcp.load(target, storage_reader=ckpt_read.ParallelReader(str(tmp_path), 2), no_dist=True)


def test_split_cuts_items_in_order_into_runs_of_about_equal_bytes() -> None:
    infos = [SimpleNamespace(length=n) for n in (10, 10, 10, 10, 40, 10, 10)]
    runs = ckpt_read._split(list(range(7)), infos, 3)
    assert [i for run in runs for i in run] == list(range(7))
    assert len(runs) == 3 and all(runs)
    assert ckpt_read._split([0], infos, 8) == [[0]]


def test_megatron_loads_inside_parallel_reads_use_it_and_nothing_changes_outside(tmp_path: Path) -> None:
    from megatron.core.dist_checkpointing.strategies import torch as strategy

    original = strategy._get_filesystem_reader
    with ckpt_read.parallel_reads(4):
        reader = strategy._get_filesystem_reader(str(tmp_path))
        assert isinstance(reader.read_data, ckpt_read.functools.partial)
        assert reader.read_data.keywords == {"threads": 4}
    assert strategy._get_filesystem_reader is original
    assert not isinstance(strategy._get_filesystem_reader(str(tmp_path)).read_data, ckpt_read.functools.partial)
    with ckpt_read.parallel_reads(1):
        assert strategy._get_filesystem_reader is original


def test_read_threads_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPDEPLOY_CKPT_READ_THREADS", "3")
    assert ckpt_read.read_threads() == 3
    monkeypatch.setenv("STEPDEPLOY_CKPT_READ_THREADS", "0")
    assert ckpt_read.read_threads() == 1
    monkeypatch.delenv("STEPDEPLOY_CKPT_READ_THREADS")
    assert 1 <= ckpt_read.read_threads() <= 8
