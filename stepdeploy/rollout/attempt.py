"""One attempt of one rung: render it, launch it through the executor, follow it, bring its metrics back.

Side effects live here (files, SSH); the decisions (gates) are pure functions in gates.py.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepdeploy import noderecords
from stepdeploy.catalog import load_model
from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Cluster
from stepdeploy.monitor.parse_workload import LAYER_METRICS
from stepdeploy.noderecords_stream import FileCursor
from stepdeploy.remote import registry
from stepdeploy.remote.executor import EventSink, Executor, RunStatus
from stepdeploy.render import RenderOptions
from stepdeploy.render.build import build_run, write_run
from stepdeploy.render.manifest import Manifest
from stepdeploy.rollout.clock import REAL, Clock
from stepdeploy.rollout.ladder import Rung, sub_cluster


@dataclass
class Live:
    """What the live view shows about the attempt in flight (updated on every poll)."""

    stage: str = ""
    rung: str = ""
    iteration: int | None = None
    total: int | None = None
    started: float = 0.0
    deadline: float | None = None
    last: dict[str, Any] = field(default_factory=dict)  # the latest metrics line
    status: RunStatus | None = None
    feed: list[str] = field(default_factory=list)
    goodput: float | None = None  # the soak's effective training time ratio so far (rollout/goodput.py)

    def note(self, line: str) -> None:
        self.feed = [*self.feed[-7:], line]


def render_attempt(cluster: Cluster, rung: Rung, opts: RenderOptions, layout: str | None, dest: Path) -> dict[str, Any]:
    """Write the rung's run directory to `dest` (render/build.py's build_run on the rung's nodes); returns the
    planner's summary (prediction) for its layout."""
    rendered, summary = build_run(sub_cluster(cluster, rung.nodes), load_model(rung.model), layout, opts,
                                  inputs={"rung": rung.as_dict()})
    write_run(rendered, dest)
    return summary


def executor_for(cluster: Cluster, local_run: Path, on_event: EventSink | None = None) -> Executor:
    """The executor of the attempt rendered in `local_run` (remote/registry.py chooses it from its manifest and
    the inventory). Its events go to `on_event`, else to the rollout's ledger (ledger_events)."""
    manifest = Manifest.load(local_run)
    try:
        return registry.create(manifest, cluster, local_run,
                               on_event=on_event or ledger_events(local_run, manifest, cluster))
    except KeyError as exc:
        raise BadInput(f"{exc.args[0]}; the run was rendered for other nodes") from None


def ledger_events(local_run: Path, manifest: Manifest, cluster: Cluster) -> EventSink:
    """An executor's events into the rollout's ledger, as kind <executor> with the attempt's stage and rung. An
    attempt lives in `<rollout>/attempts/<attempt>`, its ledger in `<rollout>/ledger.sqlite`; outside a rollout
    (no ledger there) the events go nowhere."""
    path = local_run.resolve().parent.parent / "ledger.sqlite"
    kind = registry.kind_for(manifest, cluster)
    stage, rung = manifest.stage, manifest.rung

    def sink(message: str, data: dict[str, Any]) -> None:
        if not path.exists():
            return
        from stepdeploy.ledger import Ledger

        ledger = Ledger(path)
        try:
            run_ids = ledger.run_ids()
            if run_ids:
                ledger.event(run_ids[-1], kind, message, stage=stage, rung=rung, data=data)
        finally:
            ledger.close()

    return sink


def latest_metrics(executor: Executor) -> dict[str, Any]:
    """The last metrics line rank 0 wrote (on the first node only: the others have none), or {} (also when the
    line breaks noderecords' schema: the node's fault, and the next poll reads a newer one)."""
    for result in executor.run_command("tail -n 1 out/metrics.jsonl 2>/dev/null", executor.targets[:1]):
        lines = result.stdout.strip().splitlines()
        try:
            return noderecords.metrics_record(noderecords.loads(lines[-1], allow_nan=True)) if lines else {}
        except noderecords.BadRecord:
            return {}
    return {}


def read_metrics(fetched: Path, tally: noderecords.Tally | None = None) -> list[dict[str, Any]]:
    """Every valid metrics line fetched from the nodes (rank 0 writes them; its node's copy is the one), as
    noderecords.metrics_record checks it: the gates meet numbers (NaN included) or nothing. Lines that break the
    schema are skipped and counted in `tally` (per file: the node's fault)."""
    return read_rank0_lines(fetched, "metrics.jsonl", noderecords.metrics_record, tally, allow_nan=True)


def read_phases(fetched: Path, tally: noderecords.Tally | None = None) -> list[dict[str, Any]]:
    """Every valid line of out/phases.jsonl fetched from the nodes (start-up phases and saves; rank 0 writes
    them): each has a `phase` and a finite `time` (noderecords.phase_record); the others are counted in `tally`."""
    return read_rank0_lines(fetched, "phases.jsonl", noderecords.phase_record, tally)


RANK0_CACHE = 8  # files followed at once: a soak's metrics and phases, and those of the attempts before it
# (absolute path, parse, allow_nan) -> its incremental reader, least recently used first
RANK0_FILES: OrderedDict[tuple[str, Callable[[Any], Any], bool], FileCursor] = OrderedDict()


def read_rank0_lines(fetched: Path, name: str, parse: Callable[[Any], dict[str, Any]],
                     tally: noderecords.Tally | None = None, *, allow_nan: bool = False) -> list[dict[str, Any]]:
    """The valid records of the first out/<name> below `fetched` that has any (a line cut by a kill, or one a
    node wrote against the schema, is skipped and counted). Each file is read from where the previous read of it
    stopped (noderecords_stream.FileCursor; one that shrank or whose bytes changed is read again from its start):
    `tally` counts the lines read this time, so a collection's node_data event names only the new bad lines. The
    records are shared between reads: a caller never changes one."""
    tally = noderecords.Tally() if tally is None else tally
    for path in sorted(fetched.glob(f"**/out/{name}")):
        records = _cursor(path, str(path.relative_to(fetched)), parse, allow_nan).read(tally)
        if records:
            return records
    return []


def _cursor(path: Path, source: str, parse: Callable[[Any], Any], allow_nan: bool) -> FileCursor:
    key = (os.path.abspath(path), parse, allow_nan)
    cursor = RANK0_FILES.get(key)
    if cursor is None or cursor.source != source:
        cursor = RANK0_FILES[key] = FileCursor(path, source, parse, allow_nan)
    RANK0_FILES.move_to_end(key)
    while len(RANK0_FILES) > RANK0_CACHE:
        RANK0_FILES.popitem(last=False)
    return cursor


def _number(value: Any) -> float | None:
    """A JSON number (NaN and infinities included: the gates judge those), else None."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def metric_time(metrics_line: dict[str, Any]) -> float:
    """When the line was written (0 when it does not say, or says something that is not a time)."""
    ts = _number(metrics_line.get("time"))
    return ts if ts is not None and math.isfinite(ts) else 0.0


def follow(executor: Executor, live: Live, *, deadline: float, interval: float,
           should_stop: Callable[[], bool], on_tick: Callable[[Live], None],
           check: Callable[[RunStatus], str | None] | None = None, clock: Clock = REAL) -> tuple[RunStatus, str]:
    """Poll until the run ends, the deadline passes or a stop is requested; returns (status, why it ended).
    `check` (the soak's monitors and fault injection) sees every poll; a reason it returns ends the follow.
    A requested stop is looked at first: ranks that `rollout stop` killed are a stop, not a crash to restart."""
    while True:
        status = executor.poll()
        live.status = status
        live.last = latest_metrics(executor) or live.last
        live.iteration = live.last.get("iteration", live.iteration)
        on_tick(live)
        if should_stop():
            return status, "stop requested"
        if check is not None and (reason := check(status)):
            return status, reason
        if not status.running:
            return status, "exited"
        if clock.time() >= deadline:
            return status, "deadline"
        clock.sleep(interval)


def downsample(metrics: list[dict[str, Any]], limit: int = 400) -> list[dict[str, Any]]:
    """At most `limit` lines, evenly spaced, always keeping the first and the last."""
    if len(metrics) <= limit:
        return metrics
    step = (len(metrics) - 1) / (limit - 1)
    return [metrics[round(i * step)] for i in range(limit)]


def metric_rows(metrics: list[dict[str, Any]], names: tuple[str, ...]) -> list[tuple[float, int, int, str, float]]:
    """Ledger rows (ts, rank, iteration, name, value); per-rank step times become one row per rank."""
    rows: list[tuple[float, int, int, str, float]] = []
    for m in downsample(metrics):
        iteration = _number(m.get("iteration"))
        if iteration is None or not math.isfinite(iteration):
            continue
        ts, it = metric_time(m), int(iteration)
        rows += [(ts, 0, it, name, value) for name in names if (value := _number(m.get(name))) is not None]
        per_rank = m.get("rank_step_time_s")
        if isinstance(per_rank, list):
            rows += [(ts, r, it, "rank_step_time_s", value) for r, v in enumerate(per_rank)
                     if (value := _number(v)) is not None]
        for name in LAYER_METRICS:
            per_layer = m.get(name)
            if isinstance(per_layer, dict):
                rows += [(ts, 0, it, f"{name}/{layer}", value) for layer, v in per_layer.items()
                         if (value := _number(v)) is not None]
        mtp = m.get("mtp_loss")
        if isinstance(mtp, list):
            rows += [(ts, 0, it, f"mtp_loss/{k}", value) for k, v in enumerate(mtp, 1)
                     if (value := _number(v)) is not None]
    return rows
