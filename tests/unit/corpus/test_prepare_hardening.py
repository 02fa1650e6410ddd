"""`stepdeploy data prepare` and `--data` against bad and hostile input: a missing output directory is made;
FIFOs, non-UTF-8 and empty inputs are refused by name; symbolic links planted where the output goes are never
followed; a description with wrong-typed fields (or a FIFO in its place) is one `error:` line, not a traceback
or a hang. Every refusal leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stepdeploy import corpus
from stepdeploy.cli.app import app
from stepdeploy.errors import BadInput


def prepare(*argv: str) -> object:
    return CliRunner().invoke(app, ["data", "prepare", *argv])


def refused(res: object, why: str) -> bool:
    exc = getattr(res, "exception", None)
    return isinstance(exc, BadInput) and exc.exit_code == 2 and why in exc.message and "\n" not in exc.message


@pytest.fixture
def no_hang() -> Iterator[None]:
    """A read that blocks (a FIFO nobody writes) fails the test after 10 s instead of hanging it."""
    def timeout(_signum: int, _frame: object) -> None:
        raise TimeoutError("blocked reading a FIFO")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_missing_output_directory_is_made_and_removed_again_on_failure(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text\n")
    old = os.umask(0o022)
    try:
        res = prepare(str(tmp_path / "a.txt"), "--out", str(tmp_path / "new" / "deeper" / "corpus"))
    finally:
        os.umask(old)
    assert res.exit_code == 0, (res.output, res.exception)
    assert (tmp_path / "new" / "deeper" / "corpus.bin").is_file()
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755
    (tmp_path / "bad.txt").write_bytes(b"fine\n\xff")
    res = prepare(str(tmp_path / "a.txt"), str(tmp_path / "bad.txt"), "--out", str(tmp_path / "other/sub/c"))
    assert refused(res, "not UTF-8")
    assert not (tmp_path / "other").exists()


def test_fifo_inputs_are_refused_not_read(tmp_path: Path, no_hang: None) -> None:
    os.mkfifo(tmp_path / "pipe")
    assert refused(prepare(str(tmp_path / "pipe"), "--out", str(tmp_path / "c")), "FIFO")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("text\n")
    os.mkfifo(tmp_path / "dir" / "b.txt")
    res = prepare(str(tmp_path / "dir"), "--out", str(tmp_path / "c"))
    assert refused(res, f"{tmp_path / 'dir' / 'b.txt'}: a FIFO")
    assert not list(tmp_path.glob("c.*"))


def test_non_utf8_and_empty_inputs_are_refused_by_name_and_place(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("good text\n")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    res = prepare(str(tmp_path / "good.txt"), str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "c"))
    assert refused(res, f"{tmp_path / 'latin1.txt'}: not UTF-8 text (byte 3)")
    (tmp_path / "empty.txt").write_bytes(b"")
    assert refused(prepare(str(tmp_path / "empty.txt"), "--out", str(tmp_path / "c")), "empty.txt: empty")
    (tmp_path / "docs.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert refused(prepare(str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "c")),
                   "docs.jsonl:2: not UTF-8 text (byte 28)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "empty.txt", "good.txt", "latin1.txt"]


def test_symlinks_planted_in_a_shared_output_directory_are_never_followed(tmp_path: Path) -> None:
    shared, outside = tmp_path / "shared", tmp_path / "outside"
    shared.mkdir()
    outside.mkdir()
    shared.chmod(0o1777)
    (tmp_path / "a.txt").write_text("the dataset's text\n" * 10)
    victims = {}
    for name in ("corpus.bin.tmp", "corpus.idx.tmp", "corpus.json.tmp", ".corpus.bin.tmp", "corpus.tmp"):
        victim = outside / f"victim-{name}"
        victim.write_text("not yours")
        (shared / name).symlink_to(victim)
        victims[victim] = victim.read_bytes()
    res = prepare(str(tmp_path / "a.txt"), "--out", str(shared / "corpus"))
    assert res.exit_code == 0, (res.output, res.exception)
    assert all(victim.read_bytes() == content for victim, content in victims.items())
    assert not (shared / "corpus.bin").is_symlink() and corpus.load_prepared(shared / "corpus").documents == 1

    (shared / "next.bin").symlink_to(outside / "created-through-the-link")  # dangling: exists() says no
    res = prepare(str(tmp_path / "a.txt"), "--out", str(shared / "next"))
    assert refused(res, "next.bin exists")
    assert not (outside / "created-through-the-link").exists()
    assert sorted(p.name for p in shared.iterdir() if p.name.startswith(("next", ".next"))) == ["next.bin"]


def description(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_text("text to describe\n")
    corpus.prepare([tmp_path / "a.txt"], tmp_path / "c")
    return tmp_path / "c.json"


@pytest.mark.parametrize("change", [{"documents": "x"}, {"sha256": 5}, {"tokens": -1}, {"documents": True},
                                    {"max_id": 300}, {"tokenizer": {"kind": "byte"}}, {"eod": 5000},
                                    {"sha256": {"bin": "z", "idx": "z"}}, {"tokenizer": 7}])
def test_a_description_with_wrong_fields_is_one_error_line(tmp_path: Path, change: dict[str, object]) -> None:
    meta = description(tmp_path)
    meta.write_text(json.dumps({**json.loads(meta.read_text()), **change}))
    with pytest.raises(BadInput) as refusal:
        corpus.load_prepared(tmp_path / "c")
    assert refusal.value.exit_code == 2 and "not a dataset description" in refusal.value.message
    assert "\n" not in refusal.value.message


@pytest.mark.parametrize("missing", ["documents", "sha256", "tokenizer", "vocab"])
def test_a_description_missing_a_key_is_refused(tmp_path: Path, missing: str) -> None:
    meta = description(tmp_path)
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != missing}))
    with pytest.raises(BadInput, match=f"not a dataset description .*{missing}"):
        corpus.load_prepared(tmp_path / "c")


def test_a_description_written_before_real_tokenizers_still_loads(tmp_path: Path) -> None:
    meta = description(tmp_path)
    old = {k: v for k, v in json.loads(meta.read_text()).items() if k not in ("max_id", "padded_vocab")}
    meta.write_text(json.dumps({**old, "tokenizer": "byte"}))
    loaded = corpus.load_prepared(tmp_path / "c")
    assert (loaded.tokenizer.kind, loaded.vocab, loaded.eod, loaded.max_id) == ("byte", 257, 256, 256)


def test_a_fifo_or_link_for_the_description_is_refused_without_hanging(tmp_path: Path, no_hang: None) -> None:
    os.mkfifo(tmp_path / "f.json")
    with pytest.raises(BadInput, match="not a regular file"):
        corpus.load_prepared(tmp_path / "f")
    meta = description(tmp_path)
    (tmp_path / "l.json").symlink_to(meta)
    with pytest.raises(BadInput, match="symbolic link"):
        corpus.load_prepared(tmp_path / "l")
