"""The workload's data and schedule: the learning-rate schedule both engines follow, the synthetic stream, and
megatron-core's indexed dataset format -- written by `stepdeploy data prepare` (workload/indexed.py), read by
megatron-core's own IndexedDataset and GPTDataset (the megatron engine) and by indexed.py's reader (the torch
engine)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import data  # noqa: E402  (tests/unit/workload/conftest.py puts the workload directory on sys.path)
import indexed  # noqa: E402
import schedule  # noqa: E402

from stepdeploy import corpus  # noqa: E402


def test_schedule_warms_up_then_decays_by_cosine_to_a_tenth_and_stays() -> None:
    t = {"lr": 1e-3, "warmup_iterations": 10, "decay_iterations": 110, "iterations": 10**9}
    assert schedule.lr_at(1, t) == pytest.approx(1e-4)
    assert schedule.lr_at(10, t) == pytest.approx(1e-3)
    assert schedule.lr_at(60, t) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half way: the cosine's middle
    assert schedule.lr_at(110, t) == pytest.approx(1e-4)
    assert schedule.lr_at(10**6, t) == pytest.approx(1e-4)  # a soak past its expected end keeps the floor
    rates = [schedule.lr_at(i, t) for i in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(rates))
    # without decay_iterations the schedule ends with the run (rendered runs of a fixed length)
    assert schedule.lr_at(100, {"lr": 1.0, "warmup_iterations": 1, "iterations": 100}) == pytest.approx(0.1)
    assert not math.isnan(schedule.lr_at(1, {"lr": 1.0, "warmup_iterations": 0, "iterations": 1}))


@pytest.fixture
def prepared(tmp_path: Path) -> corpus.Corpus:
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (tmp_path / "b.txt").write_bytes("ünïcödé and bytes \x00\xff".encode() * 30)
    return corpus.prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "corpus")


def test_prepared_files_are_read_alike_by_megatron_core_and_by_the_torch_engines_reader(prepared: corpus.Corpus,
                                                                                    tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    theirs, mine = IndexedDataset(str(prepared.prefix)), indexed.IndexedTokens(prepared.prefix)
    assert len(theirs) == len(mine) == prepared.documents == 2
    for i in range(2):
        assert np.array_equal(theirs[i], mine[i])
    text = (tmp_path / "a.txt").read_bytes()
    assert bytes(mine[0][:-1].astype(np.uint8)) == text and mine[0][-1] == corpus.EOD  # bytes, then the EOD
    assert prepared.tokens == len(text) + 1 + len((tmp_path / "b.txt").read_bytes()) + 1


def test_a_trained_bpe_dataset_is_read_by_the_nodes_without_its_tokenizer(tmp_path: Path) -> None:
    """The nodes read a real tokenizer's ids from .bin/.idx alone (vocab and eod from workload.json)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (tmp_path / "b.txt").write_text("pack my box with five dozen liquor jugs, ünïcödé\n" * 30)
    made = corpus.prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "bpe", train_tokenizer=300)
    theirs, mine = IndexedDataset(str(made.prefix)), indexed.IndexedTokens(made.prefix)
    assert all(np.array_equal(theirs[i], mine[i]) and mine[i][-1] == made.eod for i in range(2))
    cfg = {"model": {"vocab_size": 384}, "config_dir": str(tmp_path),
           "training": {"seed": 3, "micro_batch_size": 2, "seq_length": 16, "global_batch_size": 4, "iterations": 10},
           "data": made.workload_entry(made.prefix.name)}
    batch = data.source_for(cfg, 0, 2, "cpu", megatron=False).micro_batch(1, 0)
    assert batch.shape == (2, 17) and int(batch.max()) <= made.max_id < 300


def test_megatron_gpt_dataset_and_the_plain_reader_give_samples_of_seq_plus_one(prepared: corpus.Corpus,
                                                                               megatron_single_rank: None) -> None:
    cfg = {"model": {"vocab_size": 512}, "config_dir": str(prepared.prefix.parent),
           "training": {"seed": 3, "micro_batch_size": 2, "seq_length": 16, "global_batch_size": 4, "iterations": 10},
           "data": prepared.workload_entry(prepared.prefix.name)}
    for megatron in (True, False):
        source = data.source_for(cfg, 0, 2, "cpu", megatron=megatron)
        batch = source.micro_batch(3, 1)
        assert batch.shape == (2, 17) and batch.dtype == torch.long
        assert int(batch.max()) <= corpus.EOD
        assert torch.equal(batch, data.source_for(cfg, 0, 2, "cpu", megatron=megatron).micro_batch(3, 1))
    plain = indexed.Samples(indexed.IndexedTokens(prepared.prefix), 17)
    assert np.array_equal(plain[0][-1:], plain[1][:1])  # consecutive windows share their boundary token
    with pytest.raises(ValueError, match="vocabulary"):
        data.source_for({**cfg, "model": {"vocab_size": 100}}, 0, 2, "cpu", megatron=False)


def test_global_samples_partition_a_global_batch_over_ranks_and_micro_batches() -> None:
    seen = [i for rank in range(2) for micro in range(2) for i in data.global_samples(5, micro, rank, 3, 2, 12)]
    assert sorted(seen) == list(range(48, 60))
