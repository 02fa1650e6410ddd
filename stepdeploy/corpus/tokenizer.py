"""The tokenizers of `stepdeploy data prepare`: byte-level (no file), a Hugging Face tokenizer.json loaded offline,
or a byte-level BPE trained on the corpus itself. The `tokenizers` library is touched here only, and imported only
when a real tokenizer is asked for (render and rollout never import it; the nodes never see it)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from stepdeploy import safeio
from stepdeploy.corpus.description import BYTE, TokenizerInfo
from stepdeploy.errors import BadInput

MAX_TOKENIZER_BYTES = 64 * 2**20  # the largest published tokenizer.json files are a few tens of MiB
MIN_TRAINED, MAX_TRAINED = 257, 2**20  # 256 byte tokens and the end-of-document token; a sane upper bound
TRAINED_EOD = "<|endoftext|>"
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")  # GPT-2/Qwen, Llama 3, Llama 2/Mistral, Gemma


class Encoder(Protocol):
    info: TokenizerInfo
    saved: bytes | None  # the tokenizer.json to keep beside the dataset (None: byte-level)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's token ids, then the end-of-document id."""
        ...


class ByteEncoder:
    info, saved = BYTE, None

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.append(np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64), BYTE.eod) for text in texts]


class HuggingFaceEncoder:
    """A `tokenizers.Tokenizer`; batches are encoded by the library's own worker threads (all cores; set
    RAYON_NUM_THREADS to use fewer), without the special tokens a post-processor would add (no BOS)."""

    def __init__(self, tokenizer: Any, info: TokenizerInfo, saved: bytes) -> None:
        self.tokenizer, self.info, self.saved = tokenizer, info, saved

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        eod = self.info.eod
        return [np.append(np.asarray(enc.ids, dtype=np.int64), eod)
                for enc in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


def _vocab(tokenizer: Any) -> int:
    """One more than the largest id (added tokens may sit above the model's own vocabulary)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def _eod(tokenizer: Any, source: Path, wanted: str | None) -> int:
    names = (wanted,) if wanted is not None else EOD_CANDIDATES
    for name in names:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return int(token)
    if wanted is not None:
        raise BadInput(f"{source}: no token {wanted!r} for the end of a document",
                       hint="name one of its tokens with --eod-token")
    raise BadInput(f"{source}: none of {', '.join(EOD_CANDIDATES)} for the end of a document",
                   hint="name the tokenizer's end-of-document token with --eod-token")


def load_tokenizer(path: Path, eod_token: str | None = None) -> HuggingFaceEncoder:
    """A Hugging Face tokenizer.json (or a directory holding one), read from disk: nothing is downloaded."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    data = safeio.read_bytes(file, "tokenizer.json", MAX_TOKENIZER_BYTES)
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadInput(f"{file}: not a tokenizer.json (not UTF-8 at byte {exc.start})") from None
    except Exception as exc:  # the library raises plain Exception for any malformed file
        raise BadInput(f"{file}: not a Hugging Face tokenizer.json ({str(exc).splitlines()[0][:200]})",
                       hint="give the tokenizer.json of a Hugging Face model, or --train-tokenizer N") from None
    tokenizer.no_truncation()  # a saved truncation or padding setting would cut or pad documents
    tokenizer.no_padding()
    name = file.parent.resolve().name if file.name == "tokenizer.json" else file.stem
    info = TokenizerInfo(kind="huggingface", name=name or "tokenizer", vocab=_vocab(tokenizer),
                         eod=_eod(tokenizer, file, eod_token), sha256=hashlib.sha256(data).hexdigest())
    return HuggingFaceEncoder(tokenizer, info, data)


def train_bpe(texts: Callable[[], Iterable[str]], size: int) -> HuggingFaceEncoder:
    """A byte-level BPE of exactly `size` tokens (the 256 bytes, TRAINED_EOD as id 0, merges) trained on `texts`
    with the library's trainer: nothing downloaded, and the same texts give the same tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not MIN_TRAINED <= size <= MAX_TRAINED:
        raise BadInput(f"--train-tokenizer {size}: a byte-level BPE has {MIN_TRAINED} to {MAX_TRAINED:,} tokens "
                       "(256 bytes, the end of a document, then merges)", hint="--train-tokenizer 4096")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=[TRAINED_EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts(), trainer)
    got = tokenizer.get_vocab_size(with_added_tokens=True)
    if got != size:
        raise BadInput(f"the corpus holds enough text for a BPE of {got} tokens only, not {size}",
                       hint=f"--train-tokenizer {got}, or give more text")
    saved = tokenizer.to_str().encode()
    info = TokenizerInfo(kind="trained-bpe", name=f"bpe-{size}", vocab=size,
                         eod=int(tokenizer.token_to_id(TRAINED_EOD)), sha256=hashlib.sha256(saved).hexdigest())
    return HuggingFaceEncoder(tokenizer, info, saved)
