"""Issue 36 item 3: a node's metrics and phases files are read incrementally (rollout/attempt.py's read_rank0_lines
over noderecords_stream.FileCursor): each read goes on from where the last one stopped, a fetch that replaced the
file with a longer copy is still read from there, a file that shrank or changed is read again from its start, and a
collection's tally names only the lines read this time."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from stepdeploy import noderecords
from stepdeploy.noderecords import Tally
from stepdeploy.noderecords_stream import FileCursor
from stepdeploy.rollout import attempt
from stepdeploy.rollout.attempt import RANK0_CACHE, RANK0_FILES, read_metrics, read_phases

SOURCE = "nodes/0-n1/out/metrics.jsonl"


def _line(i: int) -> str:
    return f'{{"iteration": {i}, "loss": {10.0 / i:.4f}, "step_time_s": 0.5, "time": {1.7e9 + i}}}\n'


def _file(fetched: Path) -> Path:
    path = fetched / "nodes" / "0-n1" / "out" / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _cursor(fetched: Path) -> FileCursor:
    [cursor] = [c for (path, _, _), c in RANK0_FILES.items() if path == os.path.abspath(_file(fetched))
                and c.parse is noderecords.metrics_record]
    return cursor


def _full_read(path: Path) -> tuple[list[dict[str, object]], Tally]:
    """What the old reader gave: the whole file, parsed from its start."""
    tally = Tally()
    lines = list(noderecords.file_lines(path, SOURCE, tally))
    return noderecords.parse_lines(lines, noderecords.metrics_record, SOURCE, tally, allow_nan=True), tally


def test_each_read_parses_only_what_was_appended(tmp_path: Path) -> None:
    fetched = tmp_path / "fetched"
    path = _file(fetched)
    path.write_text("".join(_line(i) for i in range(1, 1001)))
    assert [m["iteration"] for m in read_metrics(fetched)] == list(range(1, 1001))
    size = path.stat().st_size
    assert _cursor(fetched).reads == size
    with path.open("a") as f:
        f.write("".join(_line(i) for i in range(1001, 1011)) + "[1]\n")
    tally = Tally()
    rows = read_metrics(fetched, tally)
    assert [m["iteration"] for m in rows] == list(range(1, 1011))
    assert _cursor(fetched).reads == path.stat().st_size, "the first 1,000 lines were read again"
    assert tally.bad == {SOURCE: 1} and "line 1011: not a JSON object" in tally.first[SOURCE]
    tally = Tally()
    assert len(read_metrics(fetched, tally)) == 1010 and not tally, "a read that found nothing new noted something"
    assert _cursor(fetched).reads == path.stat().st_size


def test_a_fetch_that_replaced_the_file_with_a_longer_copy_is_read_on(tmp_path: Path) -> None:
    """safe_extract replaces the fetched directory whole: a new inode, the same bytes and more."""
    fetched = tmp_path / "fetched"
    _file(fetched).write_text("".join(_line(i) for i in range(1, 501)))
    read_metrics(fetched)
    before = _cursor(fetched).reads
    staging = tmp_path / "staging"
    copy = _file(staging)
    copy.write_text("".join(_line(i) for i in range(1, 601)))
    shutil.rmtree(fetched)
    staging.rename(fetched)
    assert [m["iteration"] for m in read_metrics(fetched)] == list(range(1, 601))
    assert _cursor(fetched).reads - before == len("".join(_line(i) for i in range(501, 601)))


@pytest.mark.parametrize("change", ["truncated", "rotated", "rewritten in place"])
def test_a_file_that_shrank_or_changed_is_read_again_from_its_start(tmp_path: Path, change: str) -> None:
    fetched = tmp_path / "fetched"
    path = _file(fetched)
    path.write_text("".join(_line(i) for i in range(1, 201)))
    assert len(read_metrics(fetched)) == 200
    if change == "truncated":
        path.write_text("".join(_line(i) for i in range(1, 51)))
        expected = list(range(1, 51))
    elif change == "rotated":  # a new file, longer than the old one, that does not begin as it did
        path.unlink()
        path.write_text("".join(_line(i) for i in range(1000, 1300)))
        expected = list(range(1000, 1300))
    else:  # the same size, other bytes at the end of what was read
        text = path.read_text()
        path.write_text(text[:-len(_line(200))] + _line(200).replace('"iteration": 200', '"iteration": 999'))
        expected = [*range(1, 200), 999]
    tally = Tally()
    assert [m["iteration"] for m in read_metrics(fetched, tally)] == expected
    assert not tally


def test_a_cut_last_line_is_read_again_once_whole(tmp_path: Path) -> None:
    fetched = tmp_path / "fetched"
    path = _file(fetched)
    whole = _line(2)
    path.write_text(_line(1) + whole[:20])
    tally = Tally()
    assert [m["iteration"] for m in read_metrics(fetched, tally)] == [1]
    assert tally.bad == {SOURCE: 1}, "the cut line is the node's fault while it stays cut"
    tally = Tally()
    assert [m["iteration"] for m in read_metrics(fetched, tally)] == [1] and not tally, "noted twice"
    with path.open("a") as f:
        f.write(whole[20:])
    tally = Tally()
    assert [m["iteration"] for m in read_metrics(fetched, tally)] == [1, 2] and not tally
    path.write_text(_line(1) + whole.rstrip("\n"))  # a last line without its newline is read like the others
    assert [m["iteration"] for m in read_metrics(fetched)] == [1, 2]


def test_a_line_over_the_limit_is_counted_once_and_never_held(tmp_path: Path) -> None:
    fetched = tmp_path / "fetched"
    path = _file(fetched)
    long = '{"iteration": 3, "x": "' + "a" * (noderecords.MAX_LINE_BYTES + 10)
    path.write_text(_line(1) + long)
    tally = Tally()
    assert [m["iteration"] for m in read_metrics(fetched, tally)] == [1]
    assert "line 2: longer than" in tally.first[SOURCE]
    with path.open("a") as f:
        f.write('"}\n' + _line(4))
    tally = Tally()
    assert [m["iteration"] for m in read_metrics(fetched, tally)] == [1, 4]
    assert tally.bad == {SOURCE: 1} and "line 2: longer than" in tally.first[SOURCE]


@pytest.mark.parametrize("aligned", [False, True], ids=["cut anywhere", "whole lines"])
def test_incremental_reads_give_what_a_full_read_gives(tmp_path: Path, aligned: bool) -> None:
    """Random appends (bad lines, invalid UTF-8, blank lines; cut anywhere, or whole lines only): after each, the
    records equal a read of the whole file from its start; of whole lines, every bad one is noted exactly once."""
    rng = random.Random(36)
    fetched = tmp_path / "fetched"
    path = _file(fetched)
    path.write_bytes(b"")
    pieces = [_line(i).encode() for i in range(1, 400)] + [b"[1]\n", b"\n", b'{"iteration": 5, "t": "\xff"}\n',
                                                            b'{"iteration": NaN}\n']
    lines = [rng.choice(pieces) for _ in range(600)]
    data = b"".join(lines)
    ends = [len(b"".join(lines[:n])) for n in range(1, len(lines) + 1)]  # where each line ends
    noted, at = 0, 0
    while at < len(data):
        if aligned:
            end = ends[min(len(ends) - 1, next(i for i, e in enumerate(ends) if e > at) + rng.randrange(30))]
        else:
            end = min(len(data), at + rng.randrange(1, 4000))
        with path.open("ab") as f:
            f.write(data[at:end])
        at = end
        tally = Tally()
        assert read_metrics(fetched, tally) == _full_read(path)[0]
        noted += sum(tally.bad.values())
    if aligned:
        assert noted == sum(_full_read(path)[1].bad.values())


def test_at_most_rank0_cache_files_are_followed(tmp_path: Path) -> None:
    RANK0_FILES.clear()
    for n in range(RANK0_CACHE + 4):
        fetched = tmp_path / f"run{n}" / "fetched"
        _file(fetched).write_text(_line(n + 1))
        assert [m["iteration"] for m in read_metrics(fetched)] == [n + 1]
        read_phases(fetched)
    assert len(RANK0_FILES) == RANK0_CACHE
    assert attempt.RANK0_FILES is RANK0_FILES
