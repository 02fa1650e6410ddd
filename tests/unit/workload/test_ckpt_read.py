"""ckpt_read.py: the checkpoint read straight from the files. locate() finds a torch.save archive's bytes only where
they are the whole tensor as it is; torch DCP's load through the reader gives what torch's own reader gives, items it
does not take included; a file shorter than its metadata fails the load. (The GPU path, page-locked buffers and a
side stream, runs on the H200 only: docs/benchmarks.md, issue 37.)"""

from __future__ import annotations

import io
import os
from pathlib import Path

import ckpt_read
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")


def archive_in_file(tmp_path: Path, value: object, prefix: int = 1000) -> tuple[int, int, int]:
    """value torch.save'd into a file after `prefix` bytes of other data: (fd, start, length)."""
    blob = io.BytesIO()
    torch.save(value, blob)
    path = tmp_path / "items.bin"
    path.write_bytes(b"\xab" * prefix + blob.getvalue() + b"\xcd" * 77)
    fd = os.open(path, os.O_RDONLY)
    return fd, prefix, len(blob.getvalue())


@pytest.mark.parametrize("tensor", [torch.arange(4096, dtype=torch.bfloat16).reshape(64, 64),
                                    torch.randn(3, 5, 7), torch.tensor(3.5), torch.arange(10, dtype=torch.int64)])
def test_locate_finds_the_bytes_of_a_whole_contiguous_tensor(tmp_path: Path, tensor: torch.Tensor) -> None:
    fd, start, length = archive_in_file(tmp_path, tensor)
    try:
        saved = ckpt_read.locate(fd, start, length)
        assert saved is not None
        assert saved.dtype == tensor.dtype and saved.shape == tuple(tensor.shape)
        assert start < saved.offset and saved.offset + saved.nbytes <= start + length
        raw = os.pread(fd, saved.nbytes, saved.offset)
        assert torch.equal(torch.frombuffer(bytearray(raw), dtype=tensor.dtype).reshape(tensor.shape), tensor)
    finally:
        os.close(fd)


@pytest.mark.parametrize("value", [torch.arange(100.0)[10:30],  # a view of a larger storage: its bytes are not it
                                   torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
                                   {"weight": torch.ones(3)},  # not a tensor
                                   "text"])
def test_locate_declines_what_is_not_one_whole_contiguous_tensor(tmp_path: Path, value: object) -> None:
    fd, start, length = archive_in_file(tmp_path, value)
    try:
        assert ckpt_read.locate(fd, start, length) is None
    finally:
        os.close(fd)


def test_locate_declines_bytes_that_are_not_an_archive(tmp_path: Path) -> None:
    path = tmp_path / "junk.bin"
    path.write_bytes(os.urandom(5000))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert ckpt_read.locate(fd, 100, 4000) is None
    finally:
        os.close(fd)


def saved_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.randn(300, 64).to(torch.bfloat16), "b": torch.randn(1000), "c": torch.tensor(7),
             "large": torch.randn(3 * 1024 * 1024 // 4 + 5), "obj": {"step": 12}}
    where = tmp_path / "ckpt"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(where)), no_dist=True)
    return where, state


def test_a_load_through_the_reader_equals_the_saved_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    # pieces of 1 MiB: the 3 MiB tensor is read in four, by several threads
    monkeypatch.setattr(ckpt_read, "PIECE_BYTES", 1 << 20)
    where, state = saved_checkpoint(tmp_path)
    target = {"a": torch.zeros(300, 64, dtype=torch.bfloat16), "b": torch.zeros(1000), "c": torch.tensor(0),
              "large": torch.zeros(3 * 1024 * 1024 // 4 + 5), "obj": {"step": 0}}
    stats = ckpt_read.ReadStats()
    dcp.load(target, storage_reader=ckpt_read.reader_class()(str(where), stats), no_dist=True)
    for key in ("a", "b", "c", "large"):
        assert torch.equal(target[key], state[key]), key
    assert target["obj"] == {"step": 12}
    assert stats.direct_items == 4 and stats.other_tensors == 0 and stats.objects == 1
    assert stats.direct_bytes == sum(state[k].numel() * state[k].element_size() for k in ("a", "b", "c", "large"))


def test_an_item_it_does_not_take_goes_through_torchs_reader(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    where, state = saved_checkpoint(tmp_path)
    # "a" saved in bf16 and wanted in fp32: not the bytes as they are, so torch's reader reads and casts it
    target = {"a": torch.zeros(300, 64), "b": torch.zeros(1000)}
    stats = ckpt_read.ReadStats()
    dcp.load(target, storage_reader=ckpt_read.reader_class()(str(where), stats), no_dist=True)
    assert torch.equal(target["a"], state["a"].float()) and torch.equal(target["b"], state["b"])
    assert stats.direct_items == 1 and stats.other_tensors == 1


def test_a_checkpoint_file_shorter_than_its_metadata_fails_the_load(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    where, _ = saved_checkpoint(tmp_path)
    data = max(where.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size - 4096)  # the end of the largest tensor's bytes is gone
    target = {"large": torch.zeros(3 * 1024 * 1024 // 4 + 5)}
    # the archive's directory is at its end: the item is not recognised, and torch's reader fails on it
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=ckpt_read.reader_class()(str(where), ckpt_read.ReadStats()), no_dist=True)
    assert "central directory" in repr(caught.value.failures)


def test_a_read_past_the_end_of_the_file_fails_instead_of_leaving_the_target_half_filled(tmp_path: Path) -> None:
    # what a file cut after locate() found its item gives the direct read: an error, never a short copy
    where, _ = saved_checkpoint(tmp_path)
    data = max(where.glob("*.distcp"), key=lambda p: p.stat().st_size)
    fd = os.open(data, os.O_RDONLY)
    try:
        target = torch.zeros(4096, dtype=torch.uint8)
        piece = ckpt_read._Piece(fd, data.stat().st_size - 1000, target)
        with pytest.raises(EOFError, match="ends at byte"):
            ckpt_read.copy_pieces([piece])
    finally:
        os.close(fd)
