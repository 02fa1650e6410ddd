"""`stepdeploy data prepare`'s work: the inputs read, tokenized (in batches, by the tokenizer's worker threads)
and written as megatron-core's indexed dataset (PREFIX.bin/.idx), the tokenizer's copy (PREFIX.tokenizer.json)
and the description (PREFIX.json, written last) -- all or nothing (output.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from stepdeploy.corpus.description import Corpus
from stepdeploy.corpus.inputs import Source, documents, find_sources
from stepdeploy.corpus.output import HashingFile, Outputs
from stepdeploy.corpus.tokenizer import TRAINED_EOD, ByteEncoder, Encoder, load_tokenizer, train_bpe
from stepdeploy.errors import BadInput
from stepdeploy.workload.indexed import IndexWriter

Progress = Callable[[str, int, int], None]  # (what is being done, input bytes done, input bytes in all)
BATCH_CHARS = 4 * 2**20  # text handed to the tokenizer at once: enough to keep its threads busy
BATCH_DOCUMENTS = 1024
BYTE = "byte"


def _quiet(_what: str, _done: int, _total: int) -> None:
    return None


def batches(sources: list[Source], key: str, what: str, progress: Progress) -> Iterator[list[str]]:
    """The documents' texts in order, a few MiB at a time, reporting progress by input bytes."""
    total = sum(source.size for source in sources)
    done, batch, chars = 0, [], 0
    progress(what, 0, total)
    for text, used in documents(sources, key):
        done += used
        if text:
            batch.append(text)
            chars += len(text)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCUMENTS:
            yield batch
            batch, chars = [], 0
            progress(what, done, total)
    if batch:
        yield batch
    progress(what, total, total)


def choose_encoder(sources: list[Source], tokenizer: str | None, train_tokenizer: int | None, key: str,
                   eod_token: str | None, progress: Progress) -> Encoder:
    """The tokenizer asked for; training reads the whole corpus (so bad input is found before anything is written)."""
    if train_tokenizer is not None:
        if eod_token is not None:
            raise BadInput(f"--eod-token: a trained BPE ends documents with its own {TRAINED_EOD}",
                           hint="drop --eod-token")
        return train_bpe(lambda: (text for batch in batches(sources, key, "training tokenizer", progress)
                                  for text in batch), train_tokenizer)
    if tokenizer is None or tokenizer == BYTE:
        if eod_token is not None:
            raise BadInput("--eod-token names a token of a tokenizer.json; the byte tokenizer's is 256",
                           hint="drop --eod-token, or give --tokenizer PATH")
        return ByteEncoder()
    return load_tokenizer(Path(tokenizer), eod_token)


def _check_options(prefix: Path, tokenizer: str | None, train_tokenizer: int | None) -> None:
    if tokenizer is not None and train_tokenizer is not None:
        raise BadInput("--tokenizer and --train-tokenizer both given; a dataset has one tokenizer",
                       hint="keep one of them")
    if prefix.name in ("", ".", ".."):
        raise BadInput(f"--out {str(prefix)!r}: give a prefix that names the files (DIR/NAME writes NAME.bin, "
                       "NAME.idx and NAME.json in DIR)", hint="--out data/corpus")


def prepare(paths: Iterable[Path], prefix: Path, progress: Progress = _quiet, *, tokenizer: str | None = None,
            train_tokenizer: int | None = None, json_key: str = "text", eod_token: str | None = None) -> Corpus:
    """Tokenize every document into PREFIX.bin/.idx/.json (and PREFIX.tokenizer.json for a real tokenizer);
    `tokenizer` is "byte" (the default), or a tokenizer.json's path; `train_tokenizer` N trains a BPE of N tokens
    on the inputs instead. Refuses to overwrite anything; a missing output directory is made."""
    _check_options(prefix, tokenizer, train_tokenizer)
    sources = find_sources(paths)
    byte_level = train_tokenizer is None and tokenizer in (None, BYTE)
    order = [".bin", ".idx", *([] if byte_level else [".tokenizer.json"]), ".json"]
    outputs = Outputs(prefix)
    outputs.refuse_existing(order)
    encoder = choose_encoder(sources, tokenizer, train_tokenizer, json_key, eod_token, progress)
    with outputs:
        bin_file = HashingFile(outputs.open(".bin"))
        writer, max_id = IndexWriter(bin_file, encoder.info.vocab), 0
        for batch in batches(sources, json_key, "tokenizing", progress):
            for ids in encoder.encode(batch):
                max_id = max(max_id, int(ids.max()))
                writer.add(ids)
        sha256 = {"bin": bin_file.hexdigest(), "idx": outputs.write(".idx", writer.index())}
        info = encoder.info
        if encoder.saved is not None:
            outputs.write(".tokenizer.json", encoder.saved)
            info = info.model_copy(update={"file": f"{prefix.name}.tokenizer.json"})
        corpus = Corpus(prefix, len(writer.lengths), writer.tokens, info, max_id, sha256)
        outputs.write(".json", (json.dumps(corpus.to_json(), indent=1) + "\n").encode())
        outputs.commit(order)
    return corpus
