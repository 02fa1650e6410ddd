"""Issue 18: bad input to any command ends in one `error:` line (often a `hint:`) and exit 2, never a traceback,
a hang or a half-written file; user data reaches the terminal as text (no rich markup, no escape sequences)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer.main
from test_cli import COMMANDS  # tests/unit is on sys.path (pytest's rootdir-relative import)
from test_inventory_cli import run_main

from stepdeploy.cli.app import app
from stepdeploy.ledger import Ledger

CPU_INI = ("[cpu]\nn1 ansible_host=192.0.2.1\nn2 ansible_host=192.0.2.2\n[cpu:vars]\nstepdeploy_gpus_per_node=0\n"
           "stepdeploy_profile=sim-cpu\n")
GPU_INI = "[gpu]\nn1 ansible_host=192.0.2.1\n[gpu:vars]\nstepdeploy_gpus_per_node=8\nstepdeploy_gpu_model=H200\n"
HOSTILE = "[/x][bold]\x1b[31m\x1b]0;title\x07\u202e"


def one_error(res: int, err: str, says: str = "") -> None:
    lines = [line for line in err.splitlines() if not line.startswith(("warning: ", "note: "))]
    assert res == 2 and lines and lines[0].startswith("error: ") and says in lines[0], err
    assert len(lines) <= 2 and all(line.startswith("hint: ") for line in lines[1:]), err
    assert "Traceback" not in err and "\x1b" not in err


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inv.ini"
    path.write_text(CPU_INI)
    return path


@pytest.mark.parametrize("group", sorted({path[0] for path in COMMANDS if len(path) > 1}))
def test_every_command_group_help_shows_an_example(group: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main([group, "--help"]) == 0
    assert f"Example: stepdeploy {group} " in capsys.readouterr().out


def test_every_group_is_covered() -> None:
    groups = {name for name, cmd in typer.main.get_command(app).commands.items() if hasattr(cmd, "commands")}
    assert groups == {"sim", "inventory", "rollout", "run", "data"}


@pytest.mark.parametrize(("args", "says"), [
    (["plan", "-m", "tiny-dense", "--nodes", "2", "--gpus-per-node", "8", "--gpu", "H200", "--gbs", "-1"], "--gbs"),
    (["plan", "-m", "tiny-dense", "--nodes", "2", "--gpus-per-node", "8", "--gpu", "H200", "--seq", "0"], "--seq"),
    (["plan", "-m", "tiny-dense", "--nodes", "1000000000", "--gpus-per-node", "8", "--gpu", "H200"], "--nodes"),
    (["plan", "-m", "tiny-dense", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "H200", "--layout", "tp=²"],
     "tp takes a positive integer"),
    (["plan", "-m", "tiny-dense", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "H200", "--layout", "tp=2,tp=4"],
     "tp is given twice"),
    (["plan", "-m", "tiny-dense", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "H200", "--margin", "nan"],
     "--margin"),
    (["plan", "-m", "tiny-dense", "--nodes", "x"], "--nodes"),
    (["plan", "--no-such-option"], "No such option"),
    (["run", "stop", "somewhere", "--grace", "inf"], "--grace"),
    (["preflight", "--local", "--sizes", "1T"], "--sizes"),
    (["preflight", "--local", "--timeout", "nan"], "--timeout"),
    (["demo", "--soak-iterations", "forever"], "--soak-iterations"),
    (["demo", "--soak-iterations", "5"], "--soak-iterations"),
])
def test_bad_options_are_one_error_line(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    code = run_main(args)
    one_error(code, capsys.readouterr().err, says)
    assert time.monotonic() - started < 30  # `plan --nodes 1000000000` used to loop once per GPU


def test_plan_with_a_gpu_model_but_no_gpu_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "inv.ini"
    path.write_text("[gpu]\nn1 ansible_host=192.0.2.1\n[gpu:vars]\nstepdeploy_gpu_model=H200\n")
    one_error(run_main(["plan", "-m", "tiny-dense", "-i", str(path)]), capsys.readouterr().err,
              "not how many each node has")


def test_plan_of_a_huge_cluster_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    code = run_main(["plan", "-m", "tiny-moe", "--nodes", "100000", "--gpus-per-node", "8", "--gpu", "H200",
                     "--top", "1", "--json"])
    assert code in (0, 1) and time.monotonic() - started < 60
    assert json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("extra", "says"), [(["--lr", "inf"], "--lr"), (["--lr", "nan"], "--lr"),
                                             (["--run-id", "r1\n"], "run id"), (["--env", "A\n=1"], "--env")])
def test_render_refuses_values_that_are_not_what_they_seem(inventory: Path, tmp_path: Path, extra: list[str],
                                                           says: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    one_error(run_main(["render", "-i", str(inventory), "-m", "tiny-dense", "--out", str(out), *extra]),
              capsys.readouterr().err, says)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["inv.ini"]


@pytest.mark.parametrize("target", ["a file", "a directory with files", "under a file", "unwritable"])
def test_render_out_that_cannot_become_a_run_directory(inventory: Path, tmp_path: Path, target: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    if target == "a file":
        out.write_text("x")
    elif target == "a directory with files":
        out.mkdir()
        (out / "keep").write_text("x")
    elif target == "under a file":
        (tmp_path / "blocker").write_text("x")
        out = tmp_path / "blocker" / "out"
    else:
        out = Path("/proc/stepdeploy-test/out")
    before = sorted(p.name for p in tmp_path.iterdir())
    one_error(run_main(["render", "-i", str(inventory), "-m", "tiny-dense", "--out", str(out)]),
              capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "something was half-written"


def _ledger_with(run_dir: Path, run_id: str, reason: str) -> None:
    run_dir.mkdir(parents=True)
    led = Ledger(run_dir / "ledger.sqlite")
    led.create_run(run_id, {"inventory": "inv.ini", "model": "tiny-dense", "stages": ["warmup"]}, ["warmup"])
    led.set_stage(run_id, "warmup", "running")
    led.set_stage(run_id, "warmup", "failed", reason)
    led.verdict(run_id, "warmup", "target", "loss_finite", False, None, "finite loss", reason)
    led.close()


def test_markup_and_escape_sequences_from_a_ledger_are_shown_as_text(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "r1"
    _ledger_with(run, f"run{HOSTILE}", f"reason {HOSTILE}")
    for args in (["rollout", "status", str(run)], ["report", str(run)], ["rollout", "list", "--runs", str(tmp_path)]):
        assert run_main(args) == 0, capsys.readouterr().err
        captured = capsys.readouterr()
        text = captured.out + captured.err
        assert "[/x][bold]\\x1b[31m" in text, text  # shown as typed (the list's narrow table cuts the rest)
        assert args[1] == "list" or "\\u202e" in text  # (rich itself drops a BEL)
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text


def test_markup_in_inventory_values_and_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "[bold]inv[" / "x].ini"  # a path holding `[bold]inv[/x].ini`
    path.parent.mkdir()
    path.write_text("[gpu]\nn1 ansible_host=192.0.2.1 ansible_user='[/u]' stepdeploy_gpu_model='[/m]'\n")
    assert run_main(["inventory", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "[/u]" in out and "[/m]" in out and "[bold]inv[/x].ini" in out
    one_error(run_main(["inventory", "show", str(tmp_path / "[/missing]\x1b[2J.ini")]), capsys.readouterr().err,
              "[/missing]\\x1b[2J.ini: no such inventory file")


@pytest.mark.parametrize("target", ["a directory", "a FIFO", "under a file"])
def test_report_html_that_cannot_be_written(tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    run = tmp_path / "r1"
    _ledger_with(run, "r1", "stopped")
    html = tmp_path / "report.html"
    if target == "a directory":
        html.mkdir()
    elif target == "a FIFO":
        os.mkfifo(html)
    else:
        (tmp_path / "blocker").write_text("x")
        html = tmp_path / "blocker" / "report.html"
    before = sorted(p.name for p in tmp_path.iterdir())
    one_error(run_main(["report", str(run), "--html", str(html)]), capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(("content", "says"), [
    ("{", "not a JSON run manifest"), ('{"hello": "world"}', "not a manifest `stepdeploy render` wrote"),
    ('{"format": 1, "run_id": "r1", "run_dir": "/x", "inputs": {}, "nodes": [{"name": "n1", "dir": "../../etc"}]}',
     "nodes.0.dir"),
    ("[" * 10000 + "]" * 10000, "nested deeper"),
])
@pytest.mark.parametrize("verb", ["launch", "status", "logs", "stop", "fetch"])
def test_run_commands_refuse_a_broken_or_foreign_manifest(tmp_path: Path, content: str, says: str, verb: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "r1"
    run.mkdir()
    (run / "manifest.json").write_text(content)
    one_error(run_main(["run", verb, str(run)]), capsys.readouterr().err, says)


@pytest.mark.parametrize(("extra", "says"), [
    (["-m", "no-such-model"], "unknown model"), (["-m", "tiny-dense", "--layout", "tp=x"], "--layout"),
    (["-m", "tiny-dense", "--min-scaling-efficiency", "nan"], "--min-scaling-efficiency"),
    (["-m", "tiny-dense", "--max-step-time", "inf"], "--max-step-time"),
    (["-m", "tiny-dense", "--executor", "pbs"], "--executor"),
    (["-m", "tiny-dense", "--run-dir", "runs/bad name"], "rollout name"),
])
def test_rollout_dry_run_checks_what_a_real_run_would(inventory: Path, tmp_path: Path, extra: list[str], says: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    one_error(run_main(["rollout", "run", "-i", str(inventory), "--dry-run", *extra]), capsys.readouterr().err, says)


def test_rollout_run_checks_everything_before_its_directory_exists(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "inv.ini"
    bad.write_text("[gpu]\nn1 ansible_host=192.0.2.1 stepdeploy_gpus_per_node=eight\n")
    run = tmp_path / "runs" / "r1"
    one_error(run_main(["rollout", "run", "-i", str(bad), "-m", "tiny-dense", "--run-dir", str(run)]),
              capsys.readouterr().err, "stepdeploy_gpus_per_node")
    assert not (tmp_path / "runs").exists()


def test_a_trailing_newline_cannot_split_an_sbatch_line(tmp_path: Path) -> None:
    from stepdeploy.errors import BadInput
    from stepdeploy.render import RenderOptions

    for bad in ({"run_id": "r1\n"}, {"run_id": "r1", "extra_env": (("A\n", "1"),)},
                {"run_id": "r1", "remote_dir": "/runs\n", "executor": "slurm"}):
        with pytest.raises(BadInput):
            opts = RenderOptions(**bad)  # type: ignore[arg-type]
            from stepdeploy.render.sbatch import _DIRECTIVE_PATH

            if not _DIRECTIVE_PATH.fullmatch(opts.run_dir):
                raise BadInput("directive path")
    from stepdeploy.render.sbatch import _DIRECTIVE_PATH, _SLURM_NODE

    assert _SLURM_NODE.fullmatch("node1\n") is None and _DIRECTIVE_PATH.fullmatch("/runs/r1\n") is None


def test_no_traceback_for_a_corrupt_ledger_under_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _ledger_with(tmp_path / "good", "good", "fine")
    (tmp_path / "bad").mkdir()
    with sqlite3.connect(tmp_path / "bad" / "ledger.sqlite") as db:
        db.execute("CREATE TABLE users (name TEXT)")
    code = run_main(["rollout", "list", "--runs", str(tmp_path)])
    captured = capsys.readouterr()
    assert "good" in captured.out  # the readable ones are still listed
    assert captured.err.startswith("warning: ") and "not a stepdeploy rollout ledger" in captured.err
    one_error(code, captured.err, "could not be read")


def test_usage_errors_from_a_fresh_process_are_one_line() -> None:
    res = subprocess.run([sys.executable, "-m", "stepdeploy", "render", "--lr", "x"], capture_output=True,
                         text=True, timeout=60)
    one_error(res.returncode, res.stderr)
    assert res.stderr.splitlines()[-1] == "hint: stepdeploy render --help"


@pytest.mark.parametrize("group", ["run", "rollout", "sim", "inventory", "data"])
def test_a_bare_command_group_shows_its_help_and_one_error_line(group: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = run_main([group])
    err = capsys.readouterr().err
    assert err.startswith(f"Usage: stepdeploy {group} ")
    tail = err.splitlines()[-2:]
    assert code == 2 and tail[0].startswith(f"error: stepdeploy {group} needs a command: ")
    assert tail[1] == f"hint: stepdeploy {group} --help"
