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
from pathlib import Path
from typing import BinaryIO

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
               np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


UINT16_VOCAB = 65500  # megatron-core's DType.optimal_dtype: uint16 below this many ids, else int32


def token_dtype(vocab: int) -> np.dtype:
    """megatron's choice of the token dtype for a vocabulary of `vocab` ids."""
    return np.dtype(np.uint16) if vocab < UINT16_VOCAB else np.dtype(np.int32)


class IndexWriter:
    """Documents appended to an open .bin (any object with `write(bytes)`); `index()` is the matching .idx. The
    caller owns the files (`stepdeploy data prepare` writes both to private temporaries and renames them)."""

    def __init__(self, bin_file: BinaryIO, vocab: int) -> None:
        self.bin_file, self.dtype = bin_file, token_dtype(vocab)
        self.lengths: list[int] = []

    def add(self, document: np.ndarray) -> None:
        array = np.asarray(document, dtype=self.dtype)
        self.bin_file.write(array.tobytes(order="C"))
        self.lengths.append(int(array.size))

    @property
    def tokens(self) -> int:
        return int(sum(self.lengths))

    def index(self) -> bytes:
        lengths = np.asarray(self.lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            pointers[1:] = np.cumsum(lengths[:-1]) * self.dtype.itemsize
        document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        return b"".join((HEADER, struct.pack("<Q", VERSION), struct.pack("<B", DTYPE_CODES[self.dtype]),
                         struct.pack("<Q", len(lengths)), struct.pack("<Q", len(document_indices)),
                         lengths.astype(np.int32).tobytes(order="C"), pointers.tobytes(order="C"),
                         document_indices.tobytes(order="C")))


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
