"""The pieces the soak's recovery and every launch share: the attempt marker and the lines after it, the full
disk's signature, a failed launch named; and the seam between the rollout and the simulated cluster."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from stepdeploy.inventory import load_cluster
from stepdeploy.monitor.diagnose import ATTEMPT_MARKER, attempt_lines, diagnose
from stepdeploy.remote.executor import NodeResult
from stepdeploy.rollout import recovery
from stepdeploy.sim import faults as sim_faults
from stepdeploy.testing import FakeClock, FakeNodes
from tests.unit._source import PACKAGE, python_modules


def test_the_marker_command_appends_to_the_logs_there_are_and_quotes_its_line(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "1-node1.log").write_text("[rank 0] CUDA out of memory\n")
    command = recovery.marker_command("soak attempt 2 'quoted'; rm -rf /", 1_800_000_000.0)
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True)
    lines = (tmp_path / "logs" / "1-node1.log").read_text().splitlines()
    assert lines[0] == "[rank 0] CUDA out of memory"
    assert lines[1] == f"{ATTEMPT_MARKER}: soak attempt 2 'quoted'; rm -rf /, 2027-01-15T08:00:00Z ===="
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["1-node1.log"]  # no log made up
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    subprocess.run(["bash", "-c", command], cwd=fresh, check=True)
    assert list((fresh / "logs").iterdir()) == []  # a fresh run directory: one attempt's log, no marker needed


def test_only_the_lines_after_the_last_marker_are_diagnosed() -> None:
    log = ["node2 | torch.OutOfMemoryError: CUDA out of memory", f"node2 | {ATTEMPT_MARKER}: soak attempt 2 ====",
           "node2 | Segmentation fault", f"node2 | {ATTEMPT_MARKER}: soak attempt 3 ====", "node2 | Killed process 7"]
    assert attempt_lines(log) == ["node2 | Killed process 7"]
    assert attempt_lines(log[:3]) == ["node2 | Segmentation fault"]
    assert attempt_lines(log[:1]) == log[:1]  # no marker: one attempt's log


def test_a_full_disk_is_recognised_in_its_forms() -> None:
    for text in ("OSError: [Errno 28] No space left on device: '/var/lib/stepdeploy/runs/r/out/iter_0000020'",
                 "RuntimeError: PytorchStreamWriter failed writing file data/0: file write failed (ENOSPC)",
                 "write error: errno 28", "OSError: size mismatch in put!  0 != 1843921"):
        found = diagnose(text)
        assert [d.signature for d in found][:1] == ["disk_full"], text
        assert "df -h" in found[0].fix and "full" in found[0].cause
    assert diagnose("saved checkpoint iter_0000020 (2.1 GiB, 128 GiB free)") == []


def test_a_failed_launch_names_a_full_disk_and_anything_else_plainly() -> None:
    nodes = FakeNodes(FakeClock())
    executor = nodes.executor()
    nodes.respond(r"^df ", "/dev/sdb1 1000000 999000 2048 100% /var/lib/stepdeploy\n")
    full = [NodeResult("node2", False, "unreachable: OSError: size mismatch in put!  0 != 10")]
    assert recovery.launch_failure(executor, "soak/target", full) == (
        "soak/target: no space left on device on node2: unreachable: OSError: size mismatch in put!  0 != 10 "
        "(df: 2 MiB free on /var/lib/stepdeploy)")
    refused = [NodeResult("node2", False, "unreachable: SSHException: host key for 10.9.0.12 does not match")]
    assert recovery.launch_failure(executor, "warmup/target", refused) == (
        "warmup/target: node2: unreachable: SSHException: host key for 10.9.0.12 does not match")


def test_the_rollout_imports_nothing_of_the_simulated_cluster() -> None:
    for path in python_modules(PACKAGE / "rollout"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.startswith("stepdeploy.sim")], f"{path.name} imports {names}"
            assert not (isinstance(node, ast.ImportFrom) and node.module == "stepdeploy" and
                        any(a.name == "sim" for a in node.names)), path.name


def test_real_nodes_get_no_simulated_faults(tmp_path: Path) -> None:
    inventory = tmp_path / "inv.ini"  # no simulator state beside it
    inventory.write_text("[sim]\nnode1 ansible_host=10.9.0.11\n[sim:vars]\nstepdeploy_gpus_per_node=0\n")
    assert sim_faults.for_cluster(load_cluster(inventory)) is None
