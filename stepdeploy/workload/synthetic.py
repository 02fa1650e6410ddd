"""Synthetic training tokens that never repeat within a run (standard library + torch; shipped as a file).

A fixed random Markov chain over the vocabulary (each token has SUCCESSORS likely successors, chosen uniformly),
so the loss can fall from ln(vocab) towards ln(SUCCESSORS) by learning the chain -- not by memorising a few
micro-batches. Every micro-batch is drawn fresh from a generator seeded by (seed, iteration, micro-batch, DP
rank): the same numbers give the same tokens (a resumed run sees the data the uninterrupted run saw), and no two
micro-batches of a run are alike. The chain restarts every BLOCK tokens from a uniformly random token, so the
BLOCK - 1 transitions of all blocks are drawn together (BLOCK - 1 small kernels per micro-batch on the GPU instead
of one per position); the first token of each block carries no information.
"""

from __future__ import annotations

import torch

SUCCESSORS = 4
BLOCK = 64


def markov_table(vocab: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[vocab, SUCCESSORS] successors of every token, the same for every rank of a run."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (vocab, SUCCESSORS), generator=gen).to(device)


def stream_seed(seed: int, iteration: int, micro: int, dp_rank: int) -> int:
    return (((seed * 1_000_003 + iteration) * 1_000_033 + micro) * 1_009 + dp_rank) & 0x7FFF_FFFF_FFFF


def markov_tokens(table: torch.Tensor, seed: int, iteration: int, micro: int, dp_rank: int, rows: int,
                  length: int) -> torch.Tensor:
    """[rows, length] tokens of micro-batch `micro` of `iteration` on DP rank `dp_rank`, on the table's device."""
    device = table.device
    gen = torch.Generator(device=device).manual_seed(stream_seed(seed, iteration, micro, dp_rank))
    blocks = -(-length // BLOCK)
    tokens = torch.empty(rows * blocks, BLOCK, dtype=torch.long, device=device)
    tokens[:, 0] = torch.randint(0, table.shape[0], (rows * blocks,), generator=gen, device=device)
    choices = torch.randint(0, SUCCESSORS, (rows * blocks, BLOCK - 1), generator=gen, device=device)
    for pos in range(BLOCK - 1):
        tokens[:, pos + 1] = table[tokens[:, pos], choices[:, pos]]
    return tokens.view(rows, blocks * BLOCK)[:, :length]
