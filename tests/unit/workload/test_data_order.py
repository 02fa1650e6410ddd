"""The torch engine reads a prepared dataset in a seeded random order, as megatron's GPTDataset does: read in order,
a corpus's unusual stretch (docs/architecture.md's box-drawing diagram) came whole in consecutive batches at
iteration 51 of the demo's soak, and the spike gate failed it (10.7 against a median of 2.9)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import data  # noqa: E402  (tests/unit/workload/conftest.py puts the workload directory on sys.path)

from stepdeploy import corpus  # noqa: E402


def _cfg(prefix: Path, seed: int) -> dict:
    return {"model": {"vocab_size": 512}, "config_dir": str(prefix.parent),
            "training": {"seed": seed, "micro_batch_size": 2, "seq_length": 8, "global_batch_size": 4,
                         "iterations": 10},
            "data": {"path": prefix.name, "tokenizer": "byte", "vocab": 257, "eod": 256}}


def test_the_torch_engine_reads_samples_shuffled_by_its_seed_the_same_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(bytes(range(32, 127)) * 8)  # 760 tokens: 108 samples of 8 + 1
    corpus.prepare([tmp_path / "a.txt"], tmp_path / "c")
    import indexed

    plain = indexed.Samples(indexed.IndexedTokens(tmp_path / "c"), 9)
    source = data.source_for(_cfg(tmp_path / "c", 3), 0, 1, "cpu", megatron=False)
    first = [source.micro_batch(1, 0)[i].numpy() for i in range(2)]
    assert not any(np.array_equal(first[i], plain[i]) for i in range(2))  # not the first windows in order
    epoch = [source.dataset[i] for i in range(len(plain))]
    assert sorted(tuple(s) for s in epoch) == sorted(tuple(plain[i]) for i in range(len(plain)))  # each once
    again = data.source_for(_cfg(tmp_path / "c", 3), 1, 1, "cpu", megatron=False)  # another rank, a restart
    assert all(np.array_equal(source.dataset[i], again.dataset[i]) for i in range(len(plain)))
    other = data.source_for(_cfg(tmp_path / "c", 4), 0, 1, "cpu", megatron=False)
    assert not all(np.array_equal(source.dataset[i], other.dataset[i]) for i in range(len(plain)))
