"""The probe script round trip on this machine, the report's exit codes, JSON and table."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from rich.console import Console

from stepdeploy.preflight import probe, report
from stepdeploy.preflight.model import Report, Status, fail, ok, warning
from stepdeploy.workload import nccl_bench


def test_probe_sections_round_trip_through_sh() -> None:
    spec = probe.PreflightProbeSpec(pythons=("/nonexistent/python",), section_timeout_s=5)
    res = subprocess.run(["sh", "-c", probe.remote_command(spec)], capture_output=True, text=True, timeout=60)
    sections = probe.split(res.stdout)
    assert set(sections) == set(probe.commands(spec))
    assert sections["uname"].ok and sections["uname"].text.startswith("Linux ")
    assert sections["python"].rc == 127 and "no python found" in sections["python"].text


def test_a_hung_command_is_cut_by_its_own_timeout() -> None:
    spec = probe.PreflightProbeSpec(section_timeout_s=1)
    text = probe.script(spec).replace("uname -s -r -m", "sleep 30")
    res = subprocess.run(["sh", "-c", text], capture_output=True, text=True, timeout=60)
    assert probe.split(res.stdout)["uname"].rc == 124


def test_split_ignores_a_section_cut_off() -> None:
    out = f"{probe.MARK} begin a\nx\n\n{probe.MARK} end a 0\n{probe.MARK} begin b\npartial"
    assert list(probe.split(out)) == ["a"]


def _report() -> Report:
    return Report(nodes=["n1", "n2"], results=[
        ok("os", "Debian 12").on("n1"), ok("os", "Debian 12").on("n2"),
        fail("ecc", "uncorrectable ECC errors: GPU 0", "0 uncorrectable", "drain the node").on("n2"),
        warning("memlock", "8192 KiB", "unlimited", "limits.d").on("n1"), ok("clock", "max |skew| 0.001 s")])


def test_exit_codes() -> None:
    assert Report(nodes=["a"], results=[ok("os", "x").on("a")]).exit_code == 0
    assert Report(nodes=["a"], results=[warning("os", "x", "y", "z").on("a")]).exit_code == 0
    assert _report().exit_code == 1
    assert Report(nodes=["a"], results=[], unreachable={"a": "timeout"}).exit_code == 3


def test_json_and_table() -> None:
    data = _report().to_json()
    assert data["counts"] == {"ok": 3, "warn": 1, "fail": 1, "skip": 0}
    assert data["results"][2] == {"check": "ecc", "status": "fail", "observed": "uncorrectable ECC errors: GPU 0",
                                  "expected": "0 uncorrectable", "fix": "drain the node", "node": "n2"}
    buf = io.StringIO()
    report.render(_report(), Console(file=buf, width=160, color_system=None))
    text = buf.getvalue()
    assert "✘ uncorrectable ECC errors: GPU 0" in text and "⚠ 8192 KiB" in text
    assert "✘ n2 ecc: uncorrectable ECC errors: GPU 0\n    expected: 0 uncorrectable\n    fix: drain the node" in text
    assert text.strip().endswith("exit 1")
    assert Status.FAIL.symbol == "✘"


def test_bench_sizes_and_bus_factor() -> None:
    assert [nccl_bench.parse_size(s) for s in ("64K", "1M", "1G", "4096")] == [65536, 1 << 20, 1 << 30, 4096]
    assert nccl_bench.bus_factor(2) == 1.0 and nccl_bench.bus_factor(8) == 1.75


def test_bench_runs_with_gloo_on_one_process() -> None:
    # A subprocess: other tests of the session may hold a default process group already.
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611", "RANK": "0", "WORLD_SIZE": "1"}
    res = subprocess.run([sys.executable, nccl_bench.__file__, "--backend", "gloo", "--sizes", "4K,64K", "--iters",
                          "2", "--warmup", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r.get("size_bytes") for r in rows[:2]] == [4096, 65536] and rows[2]["summary"] and rows[2]["correct"]
