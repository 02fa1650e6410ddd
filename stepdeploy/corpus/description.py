"""PREFIX.json, the description `stepdeploy data prepare` writes beside a dataset: what its token ids mean (the
tokenizer, its vocabulary, the end-of-document id, the largest id used) and the sha256 of its .bin and .idx.
Read back as a strict pydantic model with bounds, so a hand-edited or foreign file ends in one `error:` line.

A description written before real tokenizers (`"tokenizer": "byte"`, no `max_id`) still reads: it is the
byte-level tokenizer, whose largest id is its end-of-document id 256.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from stepdeploy.errors import BadInput

SHA256 = r"^[0-9a-f]{64}$"
MAX_ID = 2**31 - 1  # int32, megatron's token dtype for a large vocabulary
MAX_COUNT = 2**48
MEGATRON_VOCAB_MULTIPLE = 128  # megatron's --make-vocab-size-divisible-by default (times TP 1)
BYTE_VOCAB, BYTE_EOD = 257, 256


def padded_vocab(vocab: int, multiple: int = MEGATRON_VOCAB_MULTIPLE) -> int:
    """The vocabulary Megatron builds for a tokenizer of `vocab` ids: rounded up to a multiple of 128."""
    return -(-vocab // multiple) * multiple


class TokenizerInfo(BaseModel):
    """Which tokenizer made the ids: `byte` (each byte its id, 256 ends a document), `huggingface` (a given
    tokenizer.json) or `trained-bpe` (a byte-level BPE trained on the corpus); the last two are saved beside
    the dataset as `file` (PREFIX.tokenizer.json) with their sha256."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")
    kind: Literal["byte", "huggingface", "trained-bpe"]
    name: str = Field(min_length=1, max_length=256)
    vocab: int = Field(ge=2, le=MAX_ID)
    eod: int = Field(ge=0, lt=MAX_ID)
    sha256: str | None = Field(default=None, pattern=SHA256)  # of the tokenizer.json
    file: str | None = Field(default=None, min_length=1, max_length=4096)

    @model_validator(mode="after")
    def _consistent(self) -> TokenizerInfo:
        if self.eod >= self.vocab:
            raise ValueError(f"end-of-document id {self.eod} outside a vocabulary of {self.vocab}")
        if (self.kind == "byte") != (self.sha256 is None):
            raise ValueError("a tokenizer file's sha256 is given for every tokenizer but `byte`")
        return self


BYTE = TokenizerInfo(kind="byte", name="byte", vocab=BYTE_VOCAB, eod=BYTE_EOD)


class Checksums(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")
    bin: str = Field(pattern=SHA256)
    idx: str = Field(pattern=SHA256)


class Description(BaseModel):
    """PREFIX.json as read back (its `prefix` and `path` are where it was written: informative only)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")
    tokenizer: TokenizerInfo
    vocab: int = Field(ge=2, le=MAX_ID)
    eod: int = Field(ge=0, lt=MAX_ID)
    max_id: int = Field(ge=0, lt=MAX_ID)
    documents: int = Field(ge=1, le=MAX_COUNT)
    tokens: int = Field(ge=1, le=MAX_COUNT)
    sha256: Checksums

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        """The first format: `"tokenizer": "byte"` and no largest id (the byte tokenizer's is its EOD)."""
        if isinstance(data, dict) and data.get("tokenizer") == "byte":
            data = {**data, "tokenizer": BYTE}
            data.setdefault("max_id", BYTE_EOD)
        return data

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _tokenizer(cls, value: Any) -> Any:
        return value.model_dump() if isinstance(value, TokenizerInfo) else value

    @model_validator(mode="after")
    def _consistent(self) -> Description:
        if (self.vocab, self.eod) != (self.tokenizer.vocab, self.tokenizer.eod):
            raise ValueError("vocab and eod differ from the tokenizer's")
        if self.max_id >= self.vocab:
            raise ValueError(f"max_id {self.max_id} outside a vocabulary of {self.vocab}")
        if self.max_id < self.eod:
            raise ValueError(f"max_id {self.max_id} below the end-of-document id {self.eod} that ends every document")
        if self.tokens < self.documents:
            raise ValueError("fewer tokens than documents (each ends with its end-of-document id)")
        return self


def parse(data: Any, source: Path) -> Description:
    """A description checked, or BadInput naming the file and its first problem (one line)."""
    try:
        return Description.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(_shown(part) for part in first["loc"]) or "the document"
        raise BadInput(f"{source}: not a dataset description `stepdeploy data prepare` wrote ({where}: "
                       f"{_shown(first['msg'], 200)})",
                       hint="prepare it again: stepdeploy data prepare FILES --out PREFIX") from None


def _shown(part: object, most: int = 40) -> str:
    """A field name or message from the file, printable and short: a key of a megabyte, or one holding a newline
    or an escape sequence, can neither flood nor split the one `error:` line."""
    text = str(part)
    if not text.isprintable():
        text = repr(text)[1:-1]
    return text if len(text) <= most else f"{text[:most]}..."


@dataclass(frozen=True)
class Corpus:
    """A prepared dataset: PREFIX.bin/.idx and what PREFIX.json says about them."""

    prefix: Path  # without .bin/.idx
    documents: int
    tokens: int
    tokenizer: TokenizerInfo
    max_id: int
    sha256: dict[str, str]  # {"bin": ..., "idx": ...}

    @classmethod
    def of(cls, prefix: Path, description: Description) -> Corpus:
        return cls(prefix, description.documents, description.tokens, description.tokenizer, description.max_id,
                   description.sha256.model_dump())

    @property
    def vocab(self) -> int:
        return self.tokenizer.vocab

    @property
    def eod(self) -> int:
        return self.tokenizer.eod

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self.vocab)

    @property
    def files(self) -> tuple[Path, Path]:
        return Path(f"{self.prefix}.bin"), Path(f"{self.prefix}.idx")

    def workload_entry(self, shipped_as: str) -> dict[str, object]:
        """workload.json's `data`: where the run directory holds the pair, and what its ids mean."""
        return {"path": shipped_as, "tokenizer": self.tokenizer.name, "vocab": self.vocab, "eod": self.eod,
                "max_id": self.max_id, "documents": self.documents, "tokens": self.tokens, "sha256": self.sha256}

    def to_json(self) -> dict[str, object]:
        """PREFIX.json (and `data prepare --json`)."""
        return {"prefix": str(self.prefix), **self.workload_entry(str(self.prefix)),
                "tokenizer": self.tokenizer.model_dump(exclude_none=True), "padded_vocab": self.padded_vocab}
