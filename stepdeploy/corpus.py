"""Training data for real: local text files tokenized into megatron-core's indexed dataset format (`stepdeploy data
prepare`), and such a dataset described for a rendered run (`render --data`, `rollout run --data`).

The tokenizer is byte-level (nothing to download or train): every byte is a token (0-255) and each file ends with
the end-of-document token 256, so the vocabulary is 257 ids -- within every catalog model's. The files are written
by workload/indexed.py (the format megatron-core's IndexedDataset and GPTDataset read) plus PREFIX.json, which
says what the ids mean and holds each file's sha256.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stepdeploy.errors import BadInput
from stepdeploy.workload import indexed

TOKENIZER = "byte"
EOD = 256
VOCAB = 257
MAX_SHIPPED_BYTES = 256 * 2**20  # a dataset travels inside the run directory: keep it small


@dataclass(frozen=True)
class Corpus:
    prefix: Path  # without .bin/.idx
    documents: int
    tokens: int
    tokenizer: str
    vocab: int
    eod: int
    sha256: dict[str, str]  # {"bin": ..., "idx": ...}

    @property
    def files(self) -> tuple[Path, Path]:
        return Path(f"{self.prefix}.bin"), Path(f"{self.prefix}.idx")

    def workload_entry(self, shipped_as: str) -> dict[str, object]:
        """workload.json's `data`: where the run directory holds the pair, and what its ids mean."""
        return {"path": shipped_as, "tokenizer": self.tokenizer, "vocab": self.vocab, "eod": self.eod,
                "documents": self.documents, "tokens": self.tokens, "sha256": self.sha256}

    def to_json(self) -> dict[str, object]:
        return {"prefix": str(self.prefix), **self.workload_entry(str(self.prefix))}


@dataclass(frozen=True)
class ShippedDataset:
    """A prepared dataset read for a run directory: its description and the bytes of its .bin and .idx."""

    corpus: Corpus
    blobs: dict[str, bytes]  # {".bin": ..., ".idx": ...}

    @classmethod
    def read(cls, corpus: Corpus) -> ShippedDataset:
        return cls(corpus, {path.suffix: path.read_bytes() for path in corpus.files})


def byte_tokens(data: bytes) -> np.ndarray:
    """A file's bytes as token ids, then the end-of-document token."""
    return np.concatenate((np.frombuffer(data, dtype=np.uint8).astype(np.uint16), np.array([EOD], np.uint16)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _inputs(paths: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            found.append(path)
        else:
            raise BadInput(f"{path}: not a file or directory", hint="give text files or directories of them")
    if not found:
        raise BadInput("no input files", hint="stepdeploy data prepare docs/ README.md --out data/corpus")
    return found


def prepare(paths: Iterable[Path], prefix: Path, progress: Callable[[int, int], None] = lambda _d, _n: None
            ) -> Corpus:
    """Tokenize every file (one document each) into PREFIX.bin/.idx/.json; refuses to overwrite."""
    files = _inputs(paths)
    if not prefix.parent.is_dir():
        raise BadInput(f"{prefix.parent}: no such directory for the output")
    existing = [p for p in (Path(f"{prefix}{s}") for s in (".bin", ".idx", ".json")) if p.exists()]
    if existing:
        raise BadInput(f"{existing[0]} exists; a dataset is never overwritten", hint="give another --out prefix")

    def documents() -> Iterable[np.ndarray]:
        for done, path in enumerate(files, 1):
            yield byte_tokens(path.read_bytes())
            progress(done, len(files))

    count, tokens = indexed.write(prefix, documents(), VOCAB)
    corpus = Corpus(prefix, count, tokens, TOKENIZER, VOCAB, EOD,
                    {"bin": _sha256(Path(f"{prefix}.bin")), "idx": _sha256(Path(f"{prefix}.idx"))})
    meta = Path(f"{prefix}.json")
    tmp = meta.with_name(meta.name + ".tmp")
    tmp.write_text(json.dumps(corpus.to_json(), indent=1) + "\n")
    tmp.replace(meta)
    return corpus


def load(prefix: Path) -> Corpus:
    """A prepared dataset, checked: its three files exist and the data files hash to what PREFIX.json says."""
    meta = Path(f"{prefix}.json")
    try:
        data = json.loads(meta.read_text())
    except FileNotFoundError:
        hint = f"stepdeploy data prepare FILES --out {prefix}"
        raise BadInput(f"{meta}: no such dataset description", hint=hint) from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"{meta}: not a dataset description ({exc})") from None
    if not isinstance(data, dict) or data.get("tokenizer") != TOKENIZER:
        raise BadInput(f"{meta}: not a dataset `stepdeploy data prepare` wrote (tokenizer {TOKENIZER})")
    corpus = Corpus(prefix, int(data["documents"]), int(data["tokens"]), TOKENIZER, int(data["vocab"]),
                    int(data["eod"]), dict(data["sha256"]))
    total = 0
    for key, path in zip(("bin", "idx"), corpus.files, strict=True):
        if not path.is_file():
            raise BadInput(f"{path}: missing", hint=f"stepdeploy data prepare FILES --out {prefix}")
        if _sha256(path) != corpus.sha256.get(key):
            raise BadInput(f"{path}: does not match {meta} (changed since it was prepared)")
        total += path.stat().st_size
    if total > MAX_SHIPPED_BYTES:
        raise BadInput(f"{prefix}: {total / 2**20:.0f} MiB; a dataset travels inside the run directory, at most "
                       f"{MAX_SHIPPED_BYTES // 2**20} MiB")
    return corpus
