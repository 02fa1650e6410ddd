"""megatron-core's indexed dataset files (PREFIX.bin + PREFIX.idx, the "MMIDIDX" format of
megatron.core.datasets.indexed_dataset), written and read without megatron-core (standard library + numpy;
shipped as a file, and imported by `stepdeploy data prepare` on the controller).

.bin: every document's tokens, one after the other, as `dtype`.
.idx: b"MMIDIDX\\x00\\x00", version (uint64 = 1), dtype code (uint8), sequence count (uint64), document-index count
(uint64), then each sequence's length (int32), each sequence's byte offset in .bin (int64), and the document
indices (int64: 0, then the number of sequences after each document; one sequence per document here).
megatron-core's own IndexedDataset and GPTDataset read these files (tests/unit/workload/test_data.py checks it).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
               np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def token_dtype(vocab: int) -> np.dtype:
    """megatron's choice: uint16 while every id fits, else int32."""
    return np.dtype(np.uint16) if vocab <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def write(prefix: Path, documents: Iterable[np.ndarray], vocab: int) -> tuple[int, int]:
    """PREFIX.bin and PREFIX.idx from token arrays, one document each; returns (documents, tokens). Written to
    temporary names and renamed, the .idx last: a reader sees a whole pair or none."""
    dtype = token_dtype(vocab)
    lengths: list[int] = []
    bin_tmp, idx_tmp = prefix.with_name(prefix.name + ".bin.tmp"), prefix.with_name(prefix.name + ".idx.tmp")
    with open(bin_tmp, "wb") as out:
        for doc in documents:
            array = np.asarray(doc, dtype=dtype)
            out.write(array.tobytes(order="C"))
            lengths.append(int(array.size))
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if lengths:
        pointers[1:] = np.cumsum(np.asarray(lengths[:-1], dtype=np.int64)) * dtype.itemsize
    document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(idx_tmp, "wb") as out:
        out.write(HEADER)
        out.write(struct.pack("<Q", VERSION))
        out.write(struct.pack("<B", DTYPE_CODES[dtype]))
        out.write(struct.pack("<Q", len(lengths)))
        out.write(struct.pack("<Q", len(document_indices)))
        out.write(np.asarray(lengths, dtype=np.int32).tobytes(order="C"))
        out.write(pointers.tobytes(order="C"))
        out.write(document_indices.tobytes(order="C"))
    bin_tmp.replace(prefix.with_name(prefix.name + ".bin"))
    idx_tmp.replace(prefix.with_name(prefix.name + ".idx"))
    return len(lengths), int(sum(lengths))


class IndexedTokens:
    """The documents of PREFIX.bin/.idx, memory-mapped; `all` is every token in document order."""

    def __init__(self, prefix: Path) -> None:
        idx = Path(str(prefix) + ".idx").read_bytes()
        if idx[:len(HEADER)] != HEADER:
            raise ValueError(f"{prefix}.idx is not an indexed dataset (no MMIDIDX header)")
        offset = len(HEADER)
        version, = struct.unpack_from("<Q", idx, offset)
        code, = struct.unpack_from("<B", idx, offset + 8)
        sequences, documents = struct.unpack_from("<QQ", idx, offset + 9)
        if version != VERSION or code not in CODE_DTYPES:
            raise ValueError(f"{prefix}.idx: version {version}, dtype code {code}: not a format this reader knows")
        offset += 25
        self.lengths = np.frombuffer(idx, dtype=np.int32, count=sequences, offset=offset)
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=sequences, offset=offset + 4 * sequences)
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=documents, offset=offset + 12 * sequences)
        self.dtype = CODE_DTYPES[code]
        self.all = np.memmap(Path(str(prefix) + ".bin"), dtype=self.dtype, mode="r")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        start = int(self.pointers[index]) // self.dtype.itemsize
        return np.asarray(self.all[start:start + int(self.lengths[index])])


class Samples:
    """Consecutive windows of `length` tokens over every document in order (documents end with their EOD)."""

    def __init__(self, tokens: IndexedTokens, length: int) -> None:
        self.tokens, self.length = tokens, length
        self.count = max(1, (len(tokens.all) - 1) // (length - 1))
        if len(tokens.all) < length:
            raise ValueError(f"the dataset holds {len(tokens.all)} tokens, fewer than one sample of {length}")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * (self.length - 1)  # each sample's last token is the next one's first (as megatron's)
        return np.asarray(self.tokens.all[start:start + self.length], dtype=np.int64)
