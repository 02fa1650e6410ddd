"""Everything a node writes is untrusted input (stepdeploy/noderecords.py): a record that breaks the schema is
skipped and counted as the node's fault, never a traceback, a hang or a huge allocation on the controller."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stepdeploy import noderecords
from stepdeploy.monitor import parse_workload, probe
from stepdeploy.noderecords import BadRecord, Tally
from stepdeploy.remote import poll_answer
from stepdeploy.remote.executor import UNREACHABLE, LogCursor, RunStatus, Target
from stepdeploy.remote.node_executor import NodeExecutor
from stepdeploy.remote.transport import LocalChannel, session_environment
from stepdeploy.rollout import goodput
from stepdeploy.rollout.attempt import latest_metrics, metric_rows, read_metrics, read_phases


def fetched(tmp_path: Path, name: str, text: str | bytes) -> Path:
    out = tmp_path / "fetched" / "nodes" / "0-n1" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_bytes(text.encode() if isinstance(text, str) else text)
    return tmp_path / "fetched"


GOOD = '{"iteration": 1, "loss": 2.5, "step_time_s": 0.5, "time": 1700000000.0}'
# each: (a metrics line a hostile node wrote, what the bad record's reason says)
HOSTILE_METRICS = [
    ("[1]", "not a JSON object"),
    ('{"iteration": NaN, "loss": 1.0}', "iteration is not an integer"),
    ('{"iteration": Infinity, "loss": 1.0}', "iteration is not an integer"),
    ('{"iteration": -Infinity}', "iteration is not an integer"),
    ('{"iteration": 1e12}', "outside 0..1e+09"),
    ('{"iteration": 1000000000000, "step_time_s": 1.0}', "iteration 1000000000000 is outside"),  # MemoryError before
    ('{"iteration": "7"}', "iteration is not an integer"),
    ('{"iteration": true}', "iteration is not an integer"),
    ('{"iteration": 3, "time": NaN}', "time is not a number"),
    ('{"iteration": 3, "time": 1e300}', "time is not a number"),
    ('{"iteration": 3, "x": ' + "[" * 5000 + "]" * 5000 + "}", "nested deeper"),
    ('{"iteration": 3, "x": ' + "[" * 20 + "]" * 20 + "}", "nested deeper"),
    ('{"iteration": 3, "x": "' + "a" * (2 * 1024 * 1024) + '"}', "longer than"),
    ('{"iteration": 1' + "0" * 5000 + "}", "not JSON"),
]


@pytest.mark.parametrize(("line", "why"), HOSTILE_METRICS, ids=[w for _, w in HOSTILE_METRICS])
def test_a_hostile_metrics_line_is_skipped_and_counted(tmp_path: Path, line: str, why: str) -> None:
    tally = Tally()
    rows = read_metrics(fetched(tmp_path, "metrics.jsonl", f"{GOOD}\n{line}\n"), tally)
    assert [r["iteration"] for r in rows] == [1]
    [(source, count)] = tally.bad.items()
    assert source == "nodes/0-n1/out/metrics.jsonl" and count == 1 and why in tally.first[source]
    metric_rows(rows, ("loss",))  # what the ledger records from them
    goodput.LiveGoodput(0.0, rows).ratio(10.0)


def test_a_nan_loss_is_kept_for_the_gates_and_a_wrong_figure_dropped(tmp_path: Path) -> None:
    line = '{"iteration": 2, "loss": NaN, "grad_norm": Infinity, "step_time_s": NaN, "lr": "high", "new_key": NaN}'
    [row] = read_metrics(fetched(tmp_path, "metrics.jsonl", line + "\n"))
    assert math.isnan(row["loss"]) and row["grad_norm"] == math.inf
    assert "step_time_s" not in row and "lr" not in row and row["new_key"] is None  # extras kept, finite


def test_latest_metrics_of_a_line_that_is_not_an_object_is_empty() -> None:
    class Executor:
        def __init__(self) -> None:
            self.targets = [object()]

        def run_command(self, command: str, targets: list[Any]) -> list[Any]:
            return [SimpleNamespace(stdout="[1]\n")]

    assert latest_metrics(Executor()) == {}  # type: ignore[arg-type]


def test_invalid_utf8_in_metrics_is_replaced_with_a_warning(tmp_path: Path) -> None:
    tally = Tally()
    rows = read_metrics(fetched(tmp_path, "metrics.jsonl", b'{"iteration": 1, "tag": "\xff"}\n' + GOOD.encode()),
                        tally)
    assert [r["iteration"] for r in rows] == [1, 1] and rows[0]["tag"] == "\ufffd"
    assert not tally.bad and "not UTF-8" in tally.describe()[0]


def test_a_fifo_is_not_read(tmp_path: Path) -> None:
    out = tmp_path / "fetched" / "n" / "out"
    out.mkdir(parents=True)
    os.mkfifo(out / "metrics.jsonl")
    tally = Tally()
    assert read_metrics(tmp_path / "fetched", tally) == []
    assert "not a regular file" in tally.describe()[0]


def test_a_start_phase_without_time_does_not_break_goodput(tmp_path: Path) -> None:
    phases = "\n".join(['{"phase": "start", "pid": 7}', '{"phase": "start", "time": NaN, "pid": 8}',
                        '{"phase": "start", "time": 100.0, "pid": 9}', '{"phase": "first_step", "time": 110.0, '
                        '"pid": 9, "iteration": 1, "step_s": 2.0}', '{"phase": "save", "time": 120.0, "began": "x"}'])
    tally = Tally()
    lines = read_phases(fetched(tmp_path, "phases.jsonl", phases), tally)
    assert [p["pid"] for p in lines] == [9, 9]
    assert tally.bad == {"nodes/0-n1/out/phases.jsonl": 3}
    metrics = [{"iteration": 1, "step_time_s": 2.0, "time": 110.0}, {"iteration": 2, "step_time_s": 1.0}]
    figures = goodput.breakdown(90.0, 200.0, metrics, lines, [], [])
    assert len(figures.starts) == 1 and figures.iterations == 2
    # and a caller that passes unchecked lines: the line without a time is left out, not a KeyError
    assert len(goodput.breakdown(90.0, 200.0, metrics, [{"phase": "start", "pid": 7}], [], []).starts) == 0


def test_a_huge_iteration_allocates_nothing_per_iteration() -> None:
    live = goodput.LiveGoodput(0.0, [{"iteration": 10**12, "step_time_s": 1.0}])
    live.observe({"iteration": 10**9, "step_time_s": 0.5})  # a restart back to 1e9: one run dropped, one kept
    live.observe({"iteration": 2 * 10**9 + 5, "step_time_s": 0.25})
    assert len(live.runs) == 3 and live.ratio(100.0) == 1.0
    assert live.productive == pytest.approx((10**9 - 1) * 1.0 + 0.5 + 0.25 * (10**9 + 5))


def test_live_goodput_drops_what_a_restart_redoes() -> None:
    live = goodput.LiveGoodput(0.0, [{"iteration": i, "step_time_s": 1.0} for i in range(1, 11)])
    live.observe({"iteration": 6, "step_time_s": 2.0})  # resumed from 5: 6..10 redone
    assert live.productive == pytest.approx(5 * 1.0 + 2.0) and live.done == 6


# --- status and heartbeat files -------------------------------------------------------------------------------


def answer(*ranks: dict[str, Any], now: float = 1000.0) -> str:
    return json.dumps({"state": "running", "exit_code": None, "launch_pid": 10, "processes": [10, 11],
                       "node": "n1", "now": now, "ranks": list(ranks)})


@pytest.mark.parametrize(("status", "why"), [
    ('{"rank": "x", "state": "running", "pid": 11}', "rank is not an integer"),
    ('[1, 2]', "not a JSON object"),
    ('"running"', "not a JSON object"),
    ('{"rank": 0, "state": "exited", "code": NaN}', "not a JSON number"),
    ('{"rank": 0, "state": "exited", "code": 1e400}', "code is not an integer (inf)"),
    ('{"rank": 0, "state": "exited", "code": 70000}', "outside -255..255"),
    ('{"rank": 0, "state": "running", "pid": Infinity}', "not a JSON number"),
    ('{"rank": 0, "state": "running", "pid": 1.5}', "pid is not an integer"),
    ('{"rank": 2000000, "state": "running"}', "outside 0..1e+06"),
    ('{"rank": 0, "state": "died", "failed_first_at": 1e300}', "failed_first_at is not a number in 0..1e+10"),
    ('{"rank": 0, "state": "died", "failed_first_at": "first"}', "failed_first_at is not a number"),
    ('{"rank": 0, "state": "died", "failed_first_at": NaN}', "not a JSON number"),
    ('{"rank": 0, "state": "exited", "stopped_after_rank": -1}', "stopped_after_rank -1 is outside"),
    ('{"rank": 0, "state": "exited", "stopped_after_rank": [1]}', "stopped_after_rank is not an integer"),
    ('{"rank": 0, "state": ' + "[" * 3000 + "]" * 3000 + "}", "nested deeper"),
    ("x" * 70_000, "longer than 64 KiB"),
])
def test_a_bad_status_file_is_the_nodes_bad_record_not_unreachable(status: str, why: str) -> None:
    good = {"file": "rank1.json", "status": '{"rank": 1, "state": "running", "pid": 11}',
            "heartbeat": '{"iteration": 5, "time": 990.0, "pid": 11}'}
    node = poll_answer.node_status("n1", answer({"file": "rank0.json", "status": status, "heartbeat": None}, good))
    assert node.state == "running" and [r.rank for r in node.ranks] == [1]
    assert node.ranks[0].iteration == 5 and node.ranks[0].heartbeat_age_s == 10.0
    assert node.bad_records == {"out/status/rank0.json": 1} and why in node.detail
    status_json = json.dumps({"nodes": [asdict(node)], "culprits": RunStatus((node,)).culprits()})
    assert '"bad_records": {"out/status/rank0.json": 1}' in status_json


def test_a_launchers_record_reaches_the_rank_status() -> None:
    """launch_ranks.py's additions to a status file (a SIGKILLed worker: died, the first of its node; a victim)."""
    died = {"rank": 1, "pid": 12, "state": "died", "code": 137, "reason": "was killed by signal 9 (SIGKILL), ...",
            "failed_first_at": 995.5, "launcher_saw": "was killed by signal 9 (SIGKILL)"}
    stopped = {"rank": 0, "pid": 11, "state": "exited", "code": 143, "stopped_after_rank": 1}
    node = poll_answer.node_status("n1", answer({"file": "rank1.json", "status": json.dumps(died), "heartbeat": None},
                                                {"file": "rank0.json", "status": json.dumps(stopped),
                                                 "heartbeat": None}))
    victim, first = node.ranks
    assert (first.state, first.code, first.failed_first_at, first.stopped_after_rank) == ("died", 137, 995.5, None)
    assert (victim.state, victim.failed_first_at, victim.stopped_after_rank) == ("exited", None, 1)
    assert not node.bad_records


def test_a_bad_heartbeat_leaves_the_rank_without_one() -> None:
    node = poll_answer.node_status("n1", answer({"file": "rank0.json", "status": '{"state": "exited", "code": 0}',
                                                 "heartbeat": '{"iteration": NaN, "time": 1.0}'}))
    [rank] = node.ranks
    assert rank.rank == 0 and rank.iteration is None and rank.heartbeat_age_s is None
    assert node.bad_records == {"out/heartbeat/rank0": 1}


@pytest.mark.parametrize("stdout", ["", "[1]", '{"state": "dancing", "ranks": []}', '{"state": "running", "ranks": 5}',
                                    '{"state": "running", "exit_code": NaN}'])
def test_an_answer_that_is_not_the_probes_is_refused(stdout: str) -> None:
    with pytest.raises(poll_answer.BadAnswer):
        poll_answer.node_status("n1", stdout)


def test_poll_with_the_real_probe_reads_bad_status_files_as_bad_records(tmp_path: Path) -> None:
    """The probe itself runs here (python3 -I, as on a node): a status file that is a list, one with a text rank
    and one not UTF-8 no longer break it (the node used to show as unreachable)."""
    run = tmp_path / "run"
    status, beats = run / "out" / "status", run / "out" / "heartbeat"
    status.mkdir(parents=True)
    beats.mkdir(parents=True)
    (run / "nodes" / "0-n1").mkdir(parents=True)
    (status / "rank0.json").write_text('{"rank": "x", "state": "running", "pid": 1}')
    (status / "rank1.json").write_text("[1]")
    (status / "rank2.json").write_bytes(b'{"rank": 2, "state": "exited", "code": 0, "reason": "ok \xff"}')
    (beats / "rank2").write_text(json.dumps({"iteration": 3, "time": time.time(), "pid": 5}))
    executor = NodeExecutor("r1", str(run), [Target("n1", LocalChannel("n1", session_environment()), "nodes/0-n1")])
    executor.python = sys.executable
    status_now = executor.poll()
    [node] = status_now.nodes
    assert node.state != UNREACHABLE, node.detail
    assert node.bad_records == {"out/status/rank0.json": 1, "out/status/rank1.json": 1}
    [rank] = node.ranks
    assert (rank.rank, rank.state, rank.code, rank.iteration, rank.reason) == (2, "exited", 0, 3, "ok \ufffd")
    json.dumps({"nodes": [asdict(n) for n in status_now.nodes], "culprits": status_now.culprits()})


def test_the_monitor_skips_and_reports_bad_rank_files() -> None:
    tally = Tally()
    statuses = parse_workload.parse_statuses('rank0.json {"rank": "x"}\nrank1.json [1]\n'
                                             'rank2.json {"state": "running", "pid": 5}', tally)
    assert [(r.rank, r.state, r.pid) for r in statuses] == [(2, "running", 5)]
    beats = parse_workload.parse_heartbeats('rank0 {"time": NaN}\nrank1 {"time": 5, "iteration": 1e12}\n'
                                            'rank2 {"time": 5.0, "iteration": 4}', tally)
    assert [(b.rank, b.iteration) for b in beats] == [(2, 4)]
    assert sum(tally.bad.values()) == 4
    rows = parse_workload.parse_metrics('[1]\n{"iteration": NaN}\n{"iteration": 3, "loss": NaN}', tally)
    assert [r.iteration for r in rows] == [3] and math.isnan(rows[0].loss)  # type: ignore[arg-type]


def test_a_probe_sample_with_bad_rank_files_names_them_as_the_sections_error() -> None:
    spec = probe.ProbeSpec(run_dir="/run")
    output = "".join(f"{probe.MARK} begin {name}\n{text}\n{probe.MARK} end {name} 0\n" for name, text in (
        ("heartbeats", 'rank0 {"time": Infinity}'), ("statuses", "rank0.json [1]"), ("metrics", "[1]")))
    sample = probe.parse(output, "n1", spec, now=10.0)
    assert "bad record(s) from the node" in sample.errors["heartbeats"]
    assert "bad record(s) from the node" in sample.errors["statuses"]
    assert "bad record(s) from the node" in sample.errors["metrics"]


def test_follow_shows_invalid_utf8_as_replacement_and_keeps_the_text_after_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    log = run / "logs" / "0-n1.log"
    log.write_bytes(b"[rank 0] bad \xff\xfe bytes\n[rank 0] next line\n[rank 0] caf\xc3")
    executor = NodeExecutor("r1", str(run), [Target("n1", LocalChannel("n1", session_environment()), "nodes/0-n1")])
    lines: list[str] = []
    cursor = LogCursor()
    assert all(r.ok for r in executor.follow(lines.append, cursor))
    with log.open("ab") as handle:
        handle.write(b"\xa9 done\n[rank 0] after\n")  # the rest of a character split between two reads
    executor.follow(lines.append, cursor)
    assert lines == ["n1 | [rank 0] bad \ufffd\ufffd bytes", "n1 | [rank 0] next line", "n1 | [rank 0] café done",
                     "n1 | [rank 0] after"]
    assert cursor.offsets["n1"] == log.stat().st_size


def test_the_records_parser_refuses_nan_outside_metrics() -> None:
    with pytest.raises(BadRecord, match="NaN"):
        noderecords.loads('{"time": NaN}')
    assert math.isnan(noderecords.loads('{"loss": NaN}', allow_nan=True)["loss"])


def test_a_node_cannot_make_its_failure_read_as_unreachable() -> None:
    """`run fetch` and friends exit 3 only for nodes the executor could not reach: a refusal that quotes a name the
    node chose ("...unreachable...") stays a failure, exit 1."""
    import typer

    from stepdeploy.cli.run import _report
    from stepdeploy.errors import EXIT_FAILED, EXIT_UNREACHABLE
    from stepdeploy.remote.executor import NodeResult

    quoted = NodeResult("n1", False, "fetch refused: member 'unreachable.log' is a symbolic link")
    for results, code in (([quoted], EXIT_FAILED), ([NodeResult("n1", False, "unreachable: TimeoutError")],
                                                    EXIT_UNREACHABLE)):
        with pytest.raises(typer.Exit) as exited:
            _report(results, "fetched")
        assert exited.value.exit_code == code
