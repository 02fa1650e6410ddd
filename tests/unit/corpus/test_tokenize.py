"""`stepdeploy data prepare` with real tokenizers: a Hugging Face tokenizer.json (trained here, in the test),
JSONL input, a BPE trained on the corpus, and the vocabulary check of `render --data` (Megatron's padding)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from stepdeploy.catalog import load_model
from stepdeploy.cli.app import app
from stepdeploy.corpus import Corpus, TokenizerInfo
from stepdeploy.errors import BadInput
from stepdeploy.render.run import check_dataset
from stepdeploy.workload.indexed import IndexedTokens

SIM_INI = """[sim]
node1 ansible_host=10.83.0.11

[sim:vars]
ansible_user=root
stepdeploy_gpus_per_node=0
stepdeploy_profile=sim-cpu
stepdeploy_train_iface=eth0
stepdeploy_fabric=ethernet
"""

TEXTS = ["The soak trains on text that does not repeat, a step after a step.\n" * 8,
         "Megatron pads the vocabulary to a multiple of 128; the model must hold it.\n" * 6,
         "Dörfer und Städte: ünïcödé text, tokenized by a byte-level BPE.\n" * 5]


def prepare(*argv: str) -> dict[str, object]:
    res = CliRunner().invoke(app, ["data", "prepare", *argv, "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)


def refused(res: object, why: str) -> bool:
    exc = getattr(res, "exception", None)
    return isinstance(exc, BadInput) and exc.exit_code == 2 and why in exc.message and "\n" not in exc.message


def texts(tmp_path: Path) -> list[Path]:
    paths = [tmp_path / f"doc{i}.txt" for i in range(len(TEXTS))]
    for path, text in zip(paths, TEXTS, strict=True):
        path.write_text(text)
    return paths


def hf_tokenizer(directory: Path, size: int = 300) -> Tokenizer:
    """A tiny byte-level BPE with </s> for its end of document, saved as directory/tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<pad>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


def test_a_hugging_face_tokenizer_json_tokenizes_and_is_saved_beside_the_dataset(tmp_path: Path) -> None:
    tokenizer = hf_tokenizer(tmp_path / "tok")
    eod = tokenizer.token_to_id("</s>")
    made = prepare(*map(str, texts(tmp_path)), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "c"))
    stored = IndexedTokens(tmp_path / "c")
    for i, text in enumerate(TEXTS):
        assert stored[i].tolist() == [*tokenizer.encode(text, add_special_tokens=False).ids, eod]
    original = (tmp_path / "tok" / "tokenizer.json").read_bytes()
    assert (tmp_path / "c.tokenizer.json").read_bytes() == original
    description = json.loads((tmp_path / "c.json").read_text())
    assert description["tokenizer"] == {"kind": "huggingface", "name": "tok", "vocab": 300, "eod": eod,
                                        "sha256": hashlib.sha256(original).hexdigest(), "file": "c.tokenizer.json"}
    assert made["max_id"] == max(int(stored[i].max()) for i in range(3)) < 300
    assert stored.dtype == np.uint16 and (tmp_path / "c.bin").stat().st_size == 2 * description["tokens"]


def test_jsonl_input_takes_one_document_per_line_from_the_named_key(tmp_path: Path) -> None:
    lines = [json.dumps({"body": text, "id": i}) for i, text in enumerate(TEXTS)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n")
    made = prepare(str(tmp_path / "docs.jsonl"), "--json-key", "body", "--tokenizer", "byte",
                   "--out", str(tmp_path / "c"))
    stored = IndexedTokens(tmp_path / "c")
    assert made["documents"] == 3
    assert [bytes(stored[i][:-1].astype(np.uint8)).decode() for i in range(3)] == TEXTS
    assert made["tokenizer"] == {"kind": "byte", "name": "byte", "vocab": 257, "eod": 256}

    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n" + json.dumps({"text": "x"}) + "\n")
    res = CliRunner().invoke(app, ["data", "prepare", str(tmp_path / "bad.jsonl"), "--json-key", "body",
                                   "--out", str(tmp_path / "d")])
    assert refused(res, f"{tmp_path / 'bad.jsonl'}:2: no 'body' field")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    res = CliRunner().invoke(app, ["data", "prepare", str(tmp_path / "list.jsonl"), "--out", str(tmp_path / "d")])
    assert refused(res, "list.jsonl:1: a JSON list where an object was expected")
    assert not list(tmp_path.glob("d.*")) and not list(tmp_path.glob(".d.*"))


def test_train_tokenizer_makes_exactly_n_tokens_deterministically(tmp_path: Path) -> None:
    inputs = list(map(str, texts(tmp_path)))
    first = prepare(*inputs, "--train-tokenizer", "300", "--out", str(tmp_path / "a"))
    second = prepare(*inputs, "--train-tokenizer", "300", "--out", str(tmp_path / "b"))
    assert first["vocab"] == 300 and first["tokenizer"]["kind"] == "trained-bpe"
    assert (second["sha256"], second["tokenizer"]["sha256"]) == (first["sha256"], first["tokenizer"]["sha256"])
    saved = Tokenizer.from_file(str(tmp_path / "a.tokenizer.json"))
    assert saved.get_vocab_size() == 300
    stored = IndexedTokens(tmp_path / "a")
    assert int(stored.all.max()) == first["max_id"] < 300
    assert [saved.decode(stored[i][:-1].tolist()) for i in range(3)] == TEXTS  # the ids stand for the text
    assert all(int(stored[i][-1]) == first["eod"] == saved.token_to_id("<|endoftext|>") for i in range(3))
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert (tmp_path / "a.tokenizer.json").read_bytes() == (tmp_path / "b.tokenizer.json").read_bytes()
    assert first["tokens"] < 0.7 * sum(len(t.encode()) for t in TEXTS)  # merges, not bytes

    too_many = CliRunner().invoke(app, ["data", "prepare", *inputs, "--train-tokenizer", "60000", "--out",
                                        str(tmp_path / "c")])
    assert refused(too_many, "enough text for a BPE of")
    assert not list(tmp_path.glob("c.*"))


def corpus_of(vocab: int) -> Corpus:
    info = TokenizerInfo(kind="huggingface", name="t", vocab=vocab, eod=0, sha256="0" * 64)
    return Corpus(Path("/data/c"), 1, 10, info, 100, {"bin": "0" * 64, "idx": "0" * 64})


def test_the_model_must_hold_the_vocabulary_padded_as_megatron_pads_it() -> None:
    gpt3 = load_model("gpt3-175b-seed")  # vocab_size 50257: GPT-2's tokenizer itself, unpadded
    with pytest.raises(BadInput, match="padded to 50304") as refusal:
        check_dataset(corpus_of(50257), gpt3)
    assert refusal.value.hint and "--train-tokenizer 50176" in refusal.value.hint
    check_dataset(corpus_of(50176), gpt3)
    check_dataset(corpus_of(8192), load_model("tiny-dense"))


def test_render_refuses_a_dataset_that_does_not_fit_before_writing_anything(tmp_path: Path) -> None:
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 8193)}}  # 8193 ids pad to 8320 > 8192
    word = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w1"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    word.save(str(tmp_path / "words.json"))
    (tmp_path / "t.txt").write_text("w1 w2 w3 w8000 " * 40)
    made = prepare(str(tmp_path / "t.txt"), "--tokenizer", str(tmp_path / "words.json"), "--out",
                   str(tmp_path / "c"))
    assert made["vocab"] == 8193 and made["max_id"] == 8000 and made["padded_vocab"] == 8320
    (tmp_path / "inv.ini").write_text(SIM_INI)
    res = CliRunner().invoke(app, ["render", "-i", str(tmp_path / "inv.ini"), "-m", "tiny-dense", "--out",
                                   str(tmp_path / "run"), "--data", str(tmp_path / "c")])
    assert refused(res, "padded to 8320 as Megatron pads them, do not fit tiny-dense's vocabulary of 8192")
    assert not (tmp_path / "run").exists()
