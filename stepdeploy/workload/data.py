"""Where a rank's training tokens come from (standard library + torch (+ megatron-core); shipped as a file).

- synthetic (no `data` in workload.json): a Markov chain drawn fresh for every micro-batch (synthetic.py) -- no
  period inside any run;
- an indexed dataset (`data.path` in workload.json: megatron-core's .bin/.idx pair that `stepdeploy data prepare`
  writes, shipped inside the run directory): the megatron engine reads it through megatron-core's own GPTDataset
  (BlendedMegatronDatasetBuilder; its shuffled sample index built in memory on every rank, since nodes share no
  filesystem); the torch engine, whose nodes have no megatron-core, through indexed.py's reader of the same files,
  in a seeded random order (Shuffled) as GPTDataset's: read in order, a corpus's unusual stretch (a diagram of
  box-drawing bytes in docs/architecture.md) comes whole, in consecutive batches whose loss the soak's spike gate
  rightly calls spikes.

Every source answers `micro_batch(iteration, micro)` with [micro-batch size, seq + 1] tokens, a function of the
iteration, the micro-batch and the DP rank alone: a resumed run sees what the interrupted one would have seen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from synthetic import markov_table, markov_tokens


class TokenSource(Protocol):
    def micro_batch(self, iteration: int, micro: int) -> torch.Tensor: ...


class SyntheticSource:
    def __init__(self, vocab: int, seed: int, dp_rank: int, mbs: int, seq: int, device: str | torch.device) -> None:
        self.table = markov_table(vocab, seed, device)
        self.seed, self.dp_rank, self.mbs, self.seq = seed, dp_rank, mbs, seq

    def micro_batch(self, iteration: int, micro: int) -> torch.Tensor:
        return markov_tokens(self.table, self.seed, iteration, micro, self.dp_rank, self.mbs, self.seq + 1)


def global_samples(iteration: int, micro: int, dp_rank: int, mbs: int, micro_batches: int, gbs: int) -> range:
    """The global sample indices of one micro-batch: a global batch of gbs samples per iteration, each DP rank
    its micro_batches x mbs of them in order."""
    first = (iteration - 1) * gbs + (dp_rank * micro_batches + micro) * mbs
    return range(first, first + mbs)


class IndexedSource:
    """Samples of seq + 1 tokens from an indexed dataset, the global sample i at position i % len."""

    def __init__(self, dataset: Any, dp_rank: int, mbs: int, micro_batches: int, gbs: int,
                 device: str | torch.device) -> None:
        self.dataset, self.dp_rank, self.mbs = dataset, dp_rank, mbs
        self.micro_batches, self.gbs, self.device = micro_batches, gbs, device

    def micro_batch(self, iteration: int, micro: int) -> torch.Tensor:
        rows = [self.dataset[i % len(self.dataset)]
                for i in global_samples(iteration, micro, self.dp_rank, self.mbs, self.micro_batches, self.gbs)]
        return torch.stack([torch.as_tensor(row, dtype=torch.long) for row in rows]).to(self.device)


class Shuffled:
    """A dataset's samples in one seeded random order (a permutation of them, as megatron's GPTDataset shuffles its
    sample index; every epoch repeats it): the same order on every rank and after a resume."""

    def __init__(self, dataset: Any, seed: int) -> None:
        import numpy as np

        self.dataset = dataset
        self.order = np.random.default_rng(seed).permutation(len(dataset))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(self.order[index])]


def dataset_prefix(cfg: dict[str, Any]) -> Path | None:
    """The indexed dataset's path prefix (without .bin/.idx), relative paths taken from workload.json's directory
    (train.py records it as `config_dir`)."""
    data = cfg.get("data")
    if not data:
        return None
    prefix = Path(data["path"])
    return prefix if prefix.is_absolute() else Path(cfg.get("config_dir", ".")) / prefix


def source_for(cfg: dict[str, Any], dp_rank: int, micro_batches: int, device: str | torch.device,
               megatron: bool) -> TokenSource:
    t = cfg["training"]
    prefix = dataset_prefix(cfg)
    if prefix is None:
        return SyntheticSource(cfg["model"]["vocab_size"], t["seed"], dp_rank, t["micro_batch_size"],
                               t["seq_length"], device)
    data = cfg["data"]
    if data["vocab"] > cfg["model"]["vocab_size"]:
        raise ValueError(f"the dataset's tokenizer has {data['vocab']} tokens, the model's vocabulary "
                         f"{cfg['model']['vocab_size']}")
    if megatron:
        dataset = megatron_gpt_dataset(prefix, t["seq_length"], t["seed"], data["eod"], data["vocab"],
                                       samples=t["iterations"] * t["global_batch_size"])
    else:
        import indexed

        dataset = Shuffled(indexed.Samples(indexed.IndexedTokens(prefix), t["seq_length"] + 1), t["seed"])
    return IndexedSource(dataset, dp_rank, t["micro_batch_size"], micro_batches, t["global_batch_size"], device)


MAX_INDEXED_SAMPLES = 1_000_000  # the sample index megatron builds for a soak; later samples wrap around


class GPTDatasetSamples:
    """megatron-core's GPTDataset as a sequence of seq + 1 token rows (its `tokens` and last `labels` token)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> torch.Tensor:
        item = self.dataset[index]
        return torch.cat((torch.as_tensor(item["tokens"]), torch.as_tensor(item["labels"][-1:])))


def megatron_gpt_dataset(prefix: Path, seq: int, seed: int, eod_id: int, vocab: int, samples: int
                         ) -> GPTDatasetSamples:
    """megatron-core's GPTDataset over the whole indexed dataset (no validation or test split), its index built on
    every rank (no cache: the nodes share no filesystem)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class ByteTokenizer:
        """What GPTDataset asks of its tokenizer (megatron-core 0.16's legacy class and 0.19's base class differ;
        both versions read only these): the vocabulary size and the end-of-document id."""

        def __init__(self) -> None:
            self.vocab_size, self.eod = vocab, eod_id
            self.unique_identifiers = {"class": "stepdeploy-byte", "vocab_size": vocab, "eod": eod_id}

    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=([str(prefix)], None), split="100,0,0",
                              tokenizer=ByteTokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=None, mmap_bin_files=True)
    wanted = min(samples, MAX_INDEXED_SAMPLES)
    train, _valid, _test = BlendedMegatronDatasetBuilder(GPTDataset, [wanted, 0, 0], lambda: True, config).build()
    return GPTDatasetSamples(train)
