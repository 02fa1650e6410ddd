"""What one node may send back to `run fetch` and to the rollout's collection (remote/safe_extract.py, issue 36 item
3): a file over MAX_FILE_BYTES, or files adding up to more than MAX_TOTAL_BYTES, are refused with one line naming
the node, the file and the limit, as that node's failure (exit 1); nothing is left outside the fresh private
directory the archive is unpacked into. Archives are built from headers that declare large sizes followed by
streams of zeros (gzip makes them a few KiB), or from sparse files, so these tests stay fast and use little disk."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from stepdeploy.errors import EXIT_FAILED, StepdeployError
from stepdeploy.remote import safe_extract
from stepdeploy.remote.executor import Target
from stepdeploy.remote.node_executor import NodeExecutor
from stepdeploy.remote.safe_extract import MAX_FILE_BYTES, MAX_TOTAL_BYTES, FetchRefused, Limits, MiB, extract
from stepdeploy.remote.transport import LocalChannel, session_environment

SMALL = Limits(file_bytes=MiB, total_bytes=4 * MiB)  # the same checks, at sizes a test can write


class Zeros(io.RawIOBase):
    """`size` zero bytes, made as they are read (never held whole)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        count = min(len(buffer), self.left)
        buffer[:count] = bytes(count)
        self.left -= count
        return count


def archive(members: list[tuple[str, int | bytes]], *, cut_after_header: bool = False) -> bytes:
    """A gzip'd tar of regular files: (name, content or a size of zeros). With `cut_after_header`, the last
    member is its header alone (it declares its size; no data follows)."""
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1) as gz, \
            tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for n, (name, body) in enumerate(members, 1):
            info = tarfile.TarInfo(name)
            info.size, info.mode = (len(body), 0o644) if isinstance(body, bytes) else (body, 0o644)
            if cut_after_header and n == len(members):
                gz.write(info.tobuf(tarfile.PAX_FORMAT))
                break
            tar.addfile(info, io.BytesIO(body) if isinstance(body, bytes) else io.BufferedReader(Zeros(body)))
    return out.getvalue()


@pytest.fixture
def fetched(tmp_path: Path) -> Path:
    """dest's parent holds the previous fetch of the node (dest) and nothing else."""
    dest = tmp_path / "fetched" / "nodes" / "0-n1"
    extract(archive([("out/metrics.jsonl", b'{"iteration": 1}\n')]), dest, "n1")
    return dest


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_the_limits_are_named_constants_of_one_file_and_one_node() -> None:
    assert [MAX_FILE_BYTES // MiB, MAX_TOTAL_BYTES // MiB] == [512, 1024]
    assert (Limits().file_bytes, Limits().total_bytes) == (MAX_FILE_BYTES, MAX_TOTAL_BYTES)
    assert MAX_FILE_BYTES < MAX_TOTAL_BYTES and NodeExecutor.fetch_limits == Limits()


def test_a_normal_archive_extracts_at_the_default_limits(tmp_path: Path) -> None:
    """What a real run's fetch holds (never checkpoints), a 2 MiB log among it."""
    members: list[tuple[str, int | bytes]] = [
        ("out/metrics.jsonl", b'{"iteration": 1, "step_time_s": 2.0}\n' * 100),
        ("out/phases.jsonl", b'{"phase": "start", "time": 1.0, "pid": 7}\n'),
        ("out/status/rank0.json", b'{"state": "running"}'), ("out/heartbeat", b"1.0\n"),
        ("out/profile-rank0.json", b"{}"), ("out/memtrace.json", b"{}"), ("logs/n1.log", 2 * MiB)]
    dest = tmp_path / "fetched" / "nodes" / "0-n1"
    done = extract(archive(members), dest, "n1")
    assert done.files == tuple(name for name, _ in members) and done.left_out == ()
    assert (dest / "logs/n1.log").stat().st_size == 2 * MiB
    assert (dest / "out/status/rank0.json").read_bytes() == b'{"state": "running"}'
    assert sorted(p.name for p in dest.parent.iterdir()) == ["0-n1"]  # no staging directory left beside it


def test_one_member_over_the_default_limit_is_refused_from_its_header(fetched: Path) -> None:
    before = _listing(fetched.parent.parent)
    data = archive([("out/metrics.jsonl", b"{}\n"), ("logs/n1.log", MAX_FILE_BYTES + 1)], cut_after_header=True)
    assert len(data) < 4096
    with pytest.raises(FetchRefused) as refused:
        extract(data, fetched, "n1")
    # a byte over: in bytes (in MiB both would read 512)
    assert str(refused.value) == ("node n1 sent 536,870,913 bytes for logs/n1.log, more than the limit of "
                                  "536,870,912 bytes per file")
    assert _listing(fetched.parent.parent) == before  # the previous fetch whole, nothing beside it


def test_one_member_over_the_limit_is_refused_by_one_byte(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    assert extract(archive([("logs/n1.log", MiB)]), dest, "n1", SMALL).files == ("logs/n1.log",)
    with pytest.raises(FetchRefused, match=r"^node n1 sent 1,048,577 bytes for logs/n1.log, more than the limit of "
                                           r"1,048,576 bytes per file$"):
        extract(archive([("out/ok", 10), ("logs/n1.log", MiB + 1)]), dest, "n1", SMALL)
    assert _listing(dest) == ["logs", "logs/n1.log"]


def test_many_members_over_the_total_are_refused_naming_the_one_that_passes_it(fetched: Path) -> None:
    before = _listing(fetched.parent.parent)
    members: list[tuple[str, int | bytes]] = [(f"out/part{i}", MiB) for i in range(6)]
    data = archive(members)
    assert len(data) < 64 * 1024
    with pytest.raises(FetchRefused) as refused:
        extract(data, fetched, "n1", SMALL)
    assert str(refused.value) == "node n1 sent 5 MiB in all by out/part4, more than the limit of 4 MiB for one node"
    assert "\n" not in str(refused.value)
    assert _listing(fetched.parent.parent) == before
    assert extract(archive(members[:4]), fetched, "n1", SMALL).files == tuple(n for n, _ in members[:4])  # == limit


def test_a_refusal_is_the_nodes_failure_with_exit_1() -> None:
    assert issubclass(FetchRefused, StepdeployError) and FetchRefused("x").exit_code == EXIT_FAILED == 1


def test_what_was_written_before_a_refusal_stays_in_a_fresh_private_directory_and_goes(
        fetched: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file is written under the staging directory (mkdtemp beside dest, 0700), removed on refusal."""
    write, staged = safe_extract._write, set()

    def watched(root_fd: int, name: str, *args: object) -> None:
        staged.add(os.readlink(f"/proc/self/fd/{root_fd}"))
        mode = os.stat(root_fd).st_mode
        assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == 0o700
        write(root_fd, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(safe_extract, "_write", watched)
    with pytest.raises(FetchRefused, match="for one node"):
        extract(archive([(f"out/part{i}", MiB) for i in range(6)]), fetched, "n1", SMALL)
    (staging,) = staged
    assert Path(staging).parent == fetched.parent and Path(staging).name.startswith(".0-n1.fetch-")
    assert not Path(staging).exists() and sorted(p.name for p in fetched.parent.iterdir()) == ["0-n1"]
    assert (fetched / "out/metrics.jsonl").read_bytes() == b'{"iteration": 1}\n'


def _node(tmp_path: Path, sparse_bytes: int) -> NodeExecutor:
    """This machine as node n1 (the local channel) with a run whose out/metrics.jsonl is a sparse file."""
    run = tmp_path / "run"
    (run / "out").mkdir(parents=True)
    (run / "logs").mkdir()
    with open(run / "out" / "metrics.jsonl", "wb") as handle:
        handle.truncate(sparse_bytes)
    return NodeExecutor("r1", str(run), [Target("n1", LocalChannel("n1", session_environment()), "nodes/0-n1")])


def test_the_executor_answers_a_file_over_the_limit_as_that_nodes_failure(tmp_path: Path) -> None:
    executor = _node(tmp_path, 3 * MiB)
    executor.fetch_limits = SMALL
    [result] = executor.fetch(tmp_path / "fetched")
    assert not result.ok and "unreachable" not in result.detail
    assert result.detail == "node n1 sent 3 MiB for out/metrics.jsonl, more than the limit of 1 MiB per file"
    assert not (tmp_path / "fetched" / "nodes" / "0-n1").exists()


def test_the_executor_refuses_an_archive_larger_than_the_total_before_unpacking(tmp_path: Path) -> None:
    executor = _node(tmp_path, 10)
    (tmp_path / "run" / "logs" / "n1.log").write_bytes(os.urandom(300 * 1024))  # does not compress
    executor.fetch_limits = Limits(file_bytes=MiB, total_bytes=100 * 1024)
    [result] = executor.fetch(tmp_path / "fetched")
    assert not result.ok
    assert result.detail == "node n1 sent a fetch.tar.gz larger than the limit of 0.1 MiB for one node; refused"
