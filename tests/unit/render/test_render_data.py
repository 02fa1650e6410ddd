"""`stepdeploy data prepare` and `render --data` end to end (CLI in process): the indexed dataset written, its
description, refusals that leave nothing behind, and the dataset shipped inside the run directory."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from stepdeploy.cli.app import app
from stepdeploy.errors import BadInput

from .test_render_cli import SIM_INI, run


def refused(res: object, why: str) -> bool:
    """Bad input: main() prints the message and exits 2 (the CLI runner hands back the exception it raises)."""
    exc = getattr(res, "exception", None)
    return isinstance(exc, BadInput) and exc.exit_code == 2 and why in exc.message


def texts(tmp_path: Path) -> Path:
    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("The soak trains on text that does not repeat.\n" * 20)
    (src / "sub" / "b.md").write_text("# Notes\nByte-level tokens: each byte one token.\n" * 10)
    return src


def test_prepare_writes_an_indexed_dataset_and_describes_it(tmp_path: Path) -> None:
    src = texts(tmp_path)
    res = CliRunner().invoke(app, ["data", "prepare", str(src), "--out", str(tmp_path / "corpus"), "--json"])
    assert res.exit_code == 0, res.output
    made = json.loads(res.stdout)
    size = len((src / "a.txt").read_bytes()) + len((src / "sub" / "b.md").read_bytes())
    assert made["documents"] == 2 and made["tokens"] == size + 2  # every byte, and one end-of-document each
    assert made["vocab"] == 257 and made["eod"] == 256
    assert (tmp_path / "corpus.bin").stat().st_size == 2 * made["tokens"]  # uint16 tokens
    assert (tmp_path / "corpus.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"


def test_prepare_refuses_bad_input_and_never_overwrites(tmp_path: Path) -> None:
    missing = CliRunner().invoke(app, ["data", "prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "c")])
    assert refused(missing, "not a file or directory")
    assert not list(tmp_path.glob("c.*"))
    src = texts(tmp_path)
    first = CliRunner().invoke(app, ["data", "prepare", str(src), "--out", str(tmp_path / "c")])
    assert first.exit_code == 0, first.output
    before = (tmp_path / "c.bin").read_bytes()
    again = CliRunner().invoke(app, ["data", "prepare", str(src / "a.txt"), "--out", str(tmp_path / "c")])
    assert refused(again, "never overwritten")
    assert (tmp_path / "c.bin").read_bytes() == before


def test_render_ships_the_dataset_in_the_run_directory(tmp_path: Path) -> None:
    prefix = tmp_path / "corpus"
    assert CliRunner().invoke(app, ["data", "prepare", str(texts(tmp_path)), "--out", str(prefix)]).exit_code == 0
    out = tmp_path / "run"
    res = run(tmp_path, SIM_INI, "-m", "tiny-dense", "--out", str(out), "--data", str(prefix))
    assert res.exit_code == 0, res.output
    assert (out / "data/corpus.bin").read_bytes() == prefix.with_suffix(".bin").read_bytes()
    entry = json.loads((out / "workload.json").read_text())["data"]
    assert entry["path"] == "data/corpus" and entry["vocab"] == 257
    files = {f["path"]: f for f in json.loads((out / "manifest.json").read_text())["files"]}
    assert files["data/corpus.idx"]["from"] == "stepdeploy data prepare"

    gone = run(tmp_path, SIM_INI, "-m", "tiny-dense", "--out", str(tmp_path / "run2"), "--data",
               str(tmp_path / "absent"))
    assert refused(gone, "no such dataset description")
    assert not (tmp_path / "run2").exists()
