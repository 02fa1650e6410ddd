"""`stepdeploy inventory show`: table, --json, and exit 2 with one stderr line on bad input."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from stepdeploy.cli.app import main
from stepdeploy.cli.inventory import render_cluster
from stepdeploy.inventory import load_cluster

REPO = Path(__file__).resolve().parents[2]
DGX = REPO / "inventory" / "dgx.ini"


def run_main(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return int(exited.value.code or 0)


def test_show_prints_a_table_of_the_nodes_and_the_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(["inventory", "show", str(DGX)]) == 0
    captured = capsys.readouterr()
    assert "dgx-01" in captured.out and "192.0.2.12" in captured.out
    assert "profile: seed-2024 (conda): driver 550.54.15, CUDA 12.3" in captured.out
    assert captured.err == ""


def test_show_json_is_the_cluster_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(["inventory", "show", str(REPO / "inventory/examples/dgx-spark-pair.yml"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [n["name"] for n in data["nodes"]] == ["spark-1", "spark-2"]
    assert data["nodes"][0]["ib_hcas"] == ["rocep1s0f1", "roceP2p1s0f1"]
    assert data["nodes"][0]["ssh"] == {"user": None, "port": 22, "private_key_file": None,
                                       "known_hosts_file": None, "connection": "ssh", "unverified_by": None,
                                       "host_key_checking": True, "proxy_jump": None}
    assert data["profile"]["name"] == "spark-cuda13"
    assert data["profile"]["torch"] == "2.11.0"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[gpu]\nnode1\n", "has no address"),
        ("[gpu:vars]\nfoo\n", "Expected key=value"),
        ("n1 ansible_host=192.0.2.1 stepdeploy_fabric=wifi\n", "stepdeploy_fabric = 'wifi'"),
    ],
)
def test_bad_inventory_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    path = tmp_path / "inv.ini"
    path.write_text(text)
    assert run_main(["inventory", "show", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ") and expected in lines[0]


def test_missing_inventory_through_the_console_script(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stepdeploy", "inventory", "show", str(tmp_path / "missing.ini")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "missing.ini: no such inventory file" in result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_yaml_through_the_console_script(tmp_path: Path) -> None:
    path = tmp_path / "inv.yml"
    path.write_text("all:\n  hosts: [\n")
    result = subprocess.run([sys.executable, "-m", "stepdeploy", "inventory", "show", str(path), "--json"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert (result.returncode, result.stdout) == (2, "")
    assert len(result.stderr.splitlines()) == 1 and "not a valid YAML inventory" in result.stderr
    assert "Traceback" not in result.stderr and "WARNING" not in result.stderr


def test_help_shows_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(["inventory", "show", "--help"]) == 0
    assert "Example: stepdeploy inventory show inventory/dgx.ini" in capsys.readouterr().out


def test_render_cluster_into_a_string() -> None:
    buffer = io.StringIO()
    cluster = load_cluster(REPO / "inventory/examples/hgx-h100-pair.ini")
    render_cluster(cluster, Console(file=buffer, width=120))
    text = buffer.getvalue()
    assert "hgx-a" in text and "infiniband/ib0" in text and "mlx5_7" in text
    assert "-@22" in text
    assert "profile: hopper-cu128 (venv): driver 570.172.08, CUDA 12.8" in text
