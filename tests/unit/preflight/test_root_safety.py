"""Issue 18: nothing preflight or the executor runs as root takes code or files a local user planted.

Each command is run for real on this machine (the same shell text goes over SSH to a node): inventory values
stay inert in the reachability check, `python -I` keeps a planted module in the working directory out of
sys.path, and every temporary file lives in a fresh private directory (mktemp -d) that is removed after.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from stepdeploy.preflight import bandwidth, collect, probe
from stepdeploy.remote import transport
from stepdeploy.remote.executor import Target
from stepdeploy.remote.local_executor import LocalExecutor
from stepdeploy.remote.transport import LocalChannel, Ran

PLANT = "open({marker!r}, 'w').write('imported as root')\nraise SystemExit('planted module ran')\n"


def test_reachability_check_keeps_hostile_names_and_addresses_inert(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    peers = [(f"n2';touch {marker};'", "127.0.0.1", 1), (f"n3$(touch {marker})", f"127.0.0.1;touch {marker}", 1)]
    res = LocalChannel("n1").run(collect.reach_command(peers, timeout_s=2), 20)
    assert not marker.exists(), "an inventory value ran in the reachability check"
    assert f"reach n2';touch {marker};' 127.0.0.1 fail" in res.stdout
    assert f"reach n3$(touch {marker}) 127.0.0.1;touch {marker} fail" in res.stdout


def test_reachability_check_still_reaches_and_parses(tmp_path: Path) -> None:
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        res = LocalChannel("n1").run(collect.reach_command([("n2", "127.0.0.1", port)]), 20)
    assert [(p.target, p.ok) for p in collect.parse_reach("n1", res.stdout)] == [("n2", True)]


def test_probe_python_ignores_modules_planted_in_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    marker = tmp_path / "PWNED"
    (tmp_path / "platform.py").write_text(PLANT.format(marker=str(marker)))
    monkeypatch.chdir(tmp_path)  # `preflight --local` runs the probe where the user stands (/tmp, say)
    command = probe.commands(probe.PreflightProbeSpec(pythons=(sys.executable,)))["python"]
    res = LocalChannel("local").run(command, 120)
    assert not marker.exists(), "the probe imported a module from its working directory"
    assert json.loads(res.stdout)["python"] == ".".join(map(str, sys.version_info[:3]))


@dataclass
class Recording:
    """A target that records what it is asked and runs it here (LocalTarget)."""

    name: str = "n1"

    def __post_init__(self) -> None:
        self.commands: list[str] = []
        self.puts: list[str] = []
        self.local = LocalChannel(self.name)

    def run(self, command: str, timeout_s: float) -> Ran:
        self.commands.append(command)
        if "torch.distributed.run" in command:
            return Ran(0, "")
        return self.local.run(command, timeout_s)

    def put(self, data: bytes, remote: str) -> None:
        self.puts.append(remote)
        parent = Path(remote).parent
        assert stat.S_IMODE(parent.stat().st_mode) == 0o700 and parent.owner() == Path.home().owner()
        self.local.put(data, remote)

    def close(self) -> None:
        return None


def test_bandwidth_sweep_runs_from_a_fresh_private_directory_removed_after() -> None:
    target = Recording()
    bandwidth.run([target], {"n1": "/opt/venv/bin/python"},
                  bandwidth.Sweep(nnodes=1, nproc_per_node=1, master_addr="127.0.0.1", backend="gloo"))
    [script] = target.puts
    workdir = str(Path(script).parent)
    assert workdir.startswith("/tmp/stepdeploy-nccl.") and script == f"{workdir}/nccl_bench.py"
    assert "/tmp/stepdeploy-nccl_bench.py" not in " ".join(target.commands)
    [torchrun] = [c for c in target.commands if "torch.distributed.run" in c]
    assert torchrun.startswith(f"cd -- {workdir} && ") and " -I -m torch.distributed.run " in torchrun
    assert target.commands[-1] == f"rm -rf -- {workdir}" and not Path(workdir).exists()


@dataclass
class OwnTmp:
    """This machine, but with a /tmp of the test's own (a private mount namespace per command): planting in
    "/tmp" here touches nobody else's /tmp."""

    tmp: Path
    name: str = "n1"

    def run(self, command: str, timeout_s: float) -> Ran:
        wrapped = f"mount --bind {shlex.quote(str(self.tmp))} /tmp && {command}"
        return LocalChannel(self.name).run(f"unshare -m sh -c {shlex.quote(wrapped)}", timeout_s)

    def put(self, data: bytes, remote: str) -> None:
        (self.tmp / Path(remote).relative_to("/tmp")).write_bytes(data)

    def close(self) -> None:
        return None


def test_the_sweep_does_not_import_a_torch_planted_in_tmp(tmp_path: Path) -> None:
    """A local user who plants /tmp/torch/ must not get code run as root (the sweep used to run
    `cd /tmp && python -m torch.distributed.run`, and -m puts the working directory first on sys.path)."""
    torch = pytest.importorskip("torch")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /tmp")
    if any(Path(p).resolve().is_relative_to("/tmp") for p in (sys.prefix, torch.__file__)):
        # the private /tmp the sweep gets would hide this interpreter or its torch (a checkout under /tmp)
        pytest.skip(f"the test's python ({sys.prefix}) or torch lives under /tmp, which the test replaces")
    own_tmp = tmp_path / "tmp"
    marker = own_tmp / "PWNED"  # /tmp/PWNED to the sweep
    (own_tmp / "torch").mkdir(parents=True)
    own_tmp.chmod(0o1777)
    (own_tmp / "torch" / "__init__.py").write_text(PLANT.format(marker="/tmp/PWNED"))
    sweep = bandwidth.Sweep(nnodes=1, nproc_per_node=1, master_addr="127.0.0.1", backend="gloo", sizes="4K",
                            iters=2, warmup=1, timeout_s=120)
    rows, summary, error = bandwidth.run([OwnTmp(own_tmp)], {"n1": sys.executable}, sweep)
    assert not marker.exists(), "the sweep imported the torch planted in /tmp"
    assert error is None and rows and summary
    assert sorted(p.name for p in own_tmp.iterdir()) == ["torch"], "the sweep left files in /tmp"


# --- the executors' node-side commands, run here -----------------------------------------------------


@dataclass
class _Recorded(LocalChannel):
    """This machine (the local executor's channel), recording every command it runs."""

    commands: list[str] | None = None

    def run(self, command: str, timeout_s: float | None = transport.CALL_TIMEOUT_S) -> Ran:
        assert self.commands is not None
        self.commands.append(command)
        return super().run(command, timeout_s)


def local_executor(run_dir: Path, cwd: Path, commands: list[str]) -> LocalExecutor:
    """The local executor, its one node this machine: its shell commands run here, in `cwd`."""
    channel = _Recorded("n1", env=transport.session_environment(), cwd=str(cwd), commands=commands)
    return LocalExecutor("r1", str(run_dir), [Target("n1", channel, "nodes/0-n1")])


def test_node_probe_ignores_modules_planted_in_the_working_directory(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    (tmp_path / "json.py").write_text(PLANT.format(marker=str(marker)))
    status = local_executor(tmp_path / "run", tmp_path, []).poll()
    assert not marker.exists(), "the node probe imported a module from its working directory"
    assert status.nodes[0].state == "not-started"


def test_fetch_packs_into_a_private_directory_and_removes_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "out").mkdir(parents=True)
    (run_dir / "out" / "metrics.jsonl").write_text('{"iteration": 1, "loss": 2.5}\n')
    commands: list[str] = []
    [result] = local_executor(run_dir, tmp_path, commands).fetch(tmp_path / "fetched")
    assert result.ok, result.detail
    assert (tmp_path / "fetched" / "nodes/0-n1" / "out" / "metrics.jsonl").read_text().startswith('{"iteration"')
    assert "/tmp/stepdeploy-fetch" not in " ".join(commands) and "mktemp -d" in commands[0]
    assert commands[-1].startswith("rm -rf -- /tmp/tmp.") and not Path(commands[-1].split()[-1]).exists()


def test_upload_refuses_a_run_directory_in_a_world_writable_parent(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: anyone could plant the predictable names below it
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text("{}")
    [refused] = local_executor(shared / "r1", tmp_path, []).prepare(run)
    assert not refused.ok and "writable by every user" in refused.detail
    assert not (shared / "r1").exists() and list(shared.iterdir()) == []
    private = tmp_path / "private"
    private.mkdir(mode=0o755)
    [uploaded] = local_executor(private / "r1", tmp_path, []).prepare(run)
    assert uploaded.ok, uploaded.detail
    assert (private / "r1" / "manifest.json").read_text() == "{}"


def test_upload_judges_a_linked_parent_by_what_it_points_to(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text("{}")
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir()
    shared.chmod(0o1777)
    (tmp_path / "to-private").symlink_to(private)  # a link's own mode is 0777: the target's is what counts
    (tmp_path / "to-shared").symlink_to(shared)
    [uploaded] = local_executor(tmp_path / "to-private" / "r1", tmp_path, []).prepare(run)
    assert uploaded.ok, uploaded.detail
    assert (private / "r1" / "manifest.json").read_text() == "{}"
    [refused] = local_executor(tmp_path / "to-shared" / "r1", tmp_path, []).prepare(run)
    assert not refused.ok and "writable by every user" in refused.detail
    assert list(shared.iterdir()) == []
