"""`run fetch` unpacks what a node sends without trusting it (remote/safe_extract.py): hostile archives -- the
CVE-2025-4517 symlink chain, absolute names, `..`, links, devices, FIFOs, oversized members, too many members --
leave nothing outside the destination, on this Python too (3.11.7 is vulnerable to the chain)."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import sys
import tarfile
from pathlib import Path

import pytest

from stepdeploy.remote import safe_extract
from stepdeploy.remote.executor import Target
from stepdeploy.remote.node_executor import NodeExecutor
from stepdeploy.remote.safe_extract import FetchRefused, Limits, extract
from stepdeploy.remote.transport import LocalChannel, session_environment


class Maker:
    """A tar.gz built member by member, as a hostile node would."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buffer, mode="w:gz", format=tarfile.PAX_FORMAT)  # noqa: SIM115

    def add(self, name: str, *, content: bytes | None = None, type: bytes = tarfile.REGTYPE, link: str = "",
            size: int | None = None, mode: int = 0o644) -> Maker:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = type, link, mode
        if type == tarfile.REGTYPE:
            data = content if content is not None else b""
            info.size = len(data) if size is None else size
            self.tar.addfile(info, io.BytesIO(data))
        else:
            self.tar.addfile(info)
        return self

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buffer.getvalue()


def cve_2025_4517(dest: Path) -> bytes:
    """CPython's test_realpath_limit_attack: directories and symlinks whose resolved path passes PATH_MAX, a link
    out through them, a hard link through that to outer/flag, then writes through both."""
    arc = Maker()
    steps = "abcdefghijklmnop"
    max_path = os.pathconf(dest.parent, "PC_PATH_MAX")
    component = "d" * ((max_path - len(str(dest)) - 1) // (len(steps) + 1))
    path = ""
    for step in steps:
        arc.add(os.path.join(path, component), type=tarfile.DIRTYPE, mode=0o777)
        arc.add(os.path.join(path, step), type=tarfile.SYMTYPE, link=component)
        path = os.path.join(path, component)
    linkpath = os.path.join(*steps, "l" * 254)
    arc.add(linkpath, type=tarfile.SYMTYPE, link=os.path.join(*[".."] * len(steps)))
    arc.add("escape", type=tarfile.SYMTYPE, link=os.path.join(linkpath, ".."))
    arc.add("flaglink", type=tarfile.LNKTYPE, link=os.path.join("escape", "flag"))
    arc.add("flaglink", content=b"overwrite")
    arc.add("escape/newfile", content=b"new")
    return arc.bytes()


def outside(root: Path, dest: Path) -> list[str]:
    """Everything under `root` that is not `dest`, in it or above it, and not the planted flag."""
    found = []
    for path in root.rglob("*"):
        if dest in path.parents or path == dest or path in dest.parents or path.name == "flag":
            continue
        found.append(str(path.relative_to(root)))
    return found


@pytest.fixture
def box(tmp_path: Path) -> tuple[Path, Path]:
    outer = tmp_path / "outer"
    outer.mkdir()
    (outer / "flag").write_text("original")
    return outer, outer / "0-n1"  # the chain's link out names the destination's parent


def test_the_cve_2025_4517_chain_lands_nothing_outside(box: tuple[Path, Path]) -> None:
    outer, dest = box
    done = extract(cve_2025_4517(dest), dest, "n1")
    assert (outer / "flag").read_text() == "original"
    assert not (outer / "newfile").exists()
    assert outside(outer, dest) == []
    assert not any(p.is_symlink() for p in dest.rglob("*"))
    assert "flaglink" in done.files and (dest / "flaglink").read_bytes() == b"overwrite"
    assert any("symbolic link" in why for why in done.left_out) and any("hard link" in why for why in done.left_out)


@pytest.mark.skipif(sys.version_info >= (3, 11, 13), reason="this Python's data filter has the CVE fix")
def test_the_chain_does_escape_tarfiles_data_filter_here(box: tuple[Path, Path]) -> None:
    """The archive above is the real attack: on this Python the filter lets it write outside (why we do not
    use extractall)."""
    outer, dest = box
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(cve_2025_4517(dest)), mode="r:gz") as archive:
        for member in archive.getmembers():  # extractall, going on past the members that fail
            with contextlib.suppress(tarfile.TarError, OSError, KeyError):
                archive.extract(member, dest, filter="data")
    escaped = (outer / "flag").read_text() != "original" or (outer / "newfile").exists()
    assert escaped, "expected CVE-2025-4517 to reproduce on this Python"


@pytest.mark.parametrize(("member", "why"), [
    ("/etc/stepdeploy-absolute", "absolute"),
    ("../escaped", ".."),
    ("out/../../escaped", ".."),
    ("out/\x1b[31mred", "control"),
])
def test_bad_names_are_left_out(box: tuple[Path, Path], member: str, why: str) -> None:
    outer, dest = box
    done = extract(Maker().add(member, content=b"x").add("out/metrics.jsonl", content=b"{}\n").bytes(), dest, "n1")
    assert done.files == ("out/metrics.jsonl",)
    assert len(done.left_out) == 1 and why in done.left_out[0]
    assert outside(outer, dest) == []
    assert not Path("/etc/stepdeploy-absolute").exists()


def test_a_hard_link_to_etc_passwd_is_not_made(box: tuple[Path, Path]) -> None:
    _outer, dest = box
    passwd = Path("/etc/passwd").read_bytes()
    done = extract(Maker().add("out/passwd", type=tarfile.LNKTYPE, link="/etc/passwd")
                   .add("out/passwd", content=b"root::0:0::/root:/bin/sh\n").bytes(), dest, "n1")
    assert Path("/etc/passwd").read_bytes() == passwd
    assert (dest / "out/passwd").stat().st_nlink == 1 and "hard link" in done.left_out[0]


def test_a_file_through_a_symlink_stays_inside(box: tuple[Path, Path]) -> None:
    outer, dest = box
    done = extract(Maker().add("out", type=tarfile.SYMTYPE, link=str(outer))
                   .add("out/newfile", content=b"through the link").bytes(), dest, "n1")
    assert not (outer / "newfile").exists() and not (dest / "out").is_symlink()
    assert (dest / "out/newfile").read_bytes() == b"through the link" and done.files == ("out/newfile",)


@pytest.mark.parametrize(("kind", "why"), [(tarfile.CHRTYPE, "device"), (tarfile.BLKTYPE, "device"),
                                           (tarfile.FIFOTYPE, "FIFO")])
def test_devices_and_fifos_are_not_made(box: tuple[Path, Path], kind: bytes, why: str) -> None:
    _outer, dest = box
    done = extract(Maker().add("out/metrics.jsonl", type=kind).bytes(), dest, "n1")
    assert done.files == () and why in done.left_out[0]
    assert not (dest / "out/metrics.jsonl").exists()


def test_a_member_over_the_limit_is_refused_by_name(box: tuple[Path, Path]) -> None:
    outer, dest = box
    data = Maker().add("logs/n1.log", content=b"x" * (3 * 1024 * 1024)).bytes()
    with pytest.raises(FetchRefused, match=r"node n1 sent 3 MiB for logs/n1.log, more than the limit of 2 MiB"):
        extract(data, dest, "n1", Limits(file_bytes=2 * 1024 * 1024))
    assert not dest.exists() and outside(outer, dest) == []
    assert [p.name for p in outer.iterdir()] == ["flag"]  # the private staging directory is gone too


def test_a_declared_size_larger_than_the_data_is_refused(box: tuple[Path, Path]) -> None:
    """A header that claims 10 GiB: refused from the header, before anything is read."""
    _outer, dest = box
    header = tarfile.TarInfo("out/metrics.jsonl")
    header.size = 10 * 1024**3
    data = gzip.compress(header.tobuf(tarfile.PAX_FORMAT) + b"\0" * 1024)
    with pytest.raises(FetchRefused, match="more than the limit of 512 MiB"):
        extract(data, dest, "n1")


def test_the_total_over_the_limit_is_refused(box: tuple[Path, Path]) -> None:
    _outer, dest = box
    arc = Maker()
    for i in range(5):
        arc.add(f"out/part{i}", content=b"y" * 1024 * 1024)
    with pytest.raises(FetchRefused, match=r"node n1 sent 4 MiB in all by out/part3, more than the limit of 3 MiB"):
        extract(arc.bytes(), dest, "n1", Limits(total_bytes=3 * 1024 * 1024))
    assert not dest.exists()


def test_a_huge_count_of_members_is_refused(box: tuple[Path, Path]) -> None:
    _outer, dest = box
    arc = Maker()
    for i in range(120):
        arc.add(f"out/status/rank{i}.json", content=b"{}")
    with pytest.raises(FetchRefused, match="more than 100 entries"):
        extract(arc.bytes(), dest, "n1", Limits(members=100))
    assert not dest.exists()


def test_a_gzip_bomb_stops_at_the_limit(box: tuple[Path, Path]) -> None:
    """An entry we skip (an unknown type) whose 64 MiB of zeros tarfile would read past: stopped at the limit."""
    _outer, dest = box
    header = tarfile.TarInfo("out/skipped")
    header.type, header.size = b"Z", 64 * 1024 * 1024
    bomb = gzip.compress(header.tobuf(tarfile.GNU_FORMAT) + b"\0" * (header.size + 1024), compresslevel=9)
    assert len(bomb) < 1024 * 1024
    with pytest.raises(FetchRefused, match="unpacked"):
        extract(bomb, dest, "n1", Limits(total_bytes=1024 * 1024))
    assert not dest.exists()


def test_a_huge_pax_header_is_refused(box: tuple[Path, Path]) -> None:
    _outer, dest = box
    arc = Maker()
    info = tarfile.TarInfo("out/x")
    info.pax_headers = {"comment": "z" * (2 * 1024 * 1024)}
    arc.tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(FetchRefused, match="header"):
        extract(arc.bytes(), dest, "n1")


def test_not_an_archive_is_refused(box: tuple[Path, Path]) -> None:
    with pytest.raises(FetchRefused, match="not a gzip'd tar"):
        extract(b"this is not gzip", box[1], "n1")


def test_a_fetch_replaces_the_previous_one_whole_with_private_files(box: tuple[Path, Path]) -> None:
    _outer, dest = box
    extract(Maker().add("out/old", content=b"1").bytes(), dest, "n1")
    extract(Maker().add("out/metrics.jsonl", content=b"{}\n").bytes(), dest, "n1")
    assert sorted(p.name for p in dest.rglob("*")) == ["metrics.jsonl", "out"]
    assert dest.stat().st_mode & 0o777 == 0o700 and (dest / "out/metrics.jsonl").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name, "flag"]  # nothing left beside it


def test_names_are_checked() -> None:
    assert safe_extract.check_name("out/./metrics.jsonl") == "out/metrics.jsonl"
    for bad in ("", "/abs", "a/../b", "..", "a\\b", "/".join("d" * 17)):
        with pytest.raises(ValueError):
            safe_extract.check_name(bad)


def test_fetch_through_the_executor_refuses_what_the_node_sends_over_the_limit(tmp_path: Path) -> None:
    """The executor's fetch (local channel: this machine is the node) answers the limit as the node's failure."""
    run = tmp_path / "run"
    (run / "out").mkdir(parents=True)
    (run / "out" / "metrics.jsonl").write_bytes(os.urandom(300 * 1024))
    (run / "logs").mkdir()
    executor = NodeExecutor("r1", str(run), [Target("n1", LocalChannel("n1", session_environment()), "nodes/0-n1")])
    executor.fetch_limits = Limits(file_bytes=100 * 1024)
    [result] = executor.fetch(tmp_path / "fetched")
    assert not result.ok
    assert "node n1 sent 0.3 MiB for out/metrics.jsonl, more than the limit of 0.1 MiB" in result.detail
    executor.fetch_limits = Limits()
    [result] = executor.fetch(tmp_path / "fetched")
    assert result.ok, result.detail
    assert (tmp_path / "fetched/nodes/0-n1/out/metrics.jsonl").stat().st_size == 300 * 1024
