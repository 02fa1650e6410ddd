"""Rollout progress for people: a rich live view on a terminal, plain periodic lines elsewhere."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from stepdeploy.ledger import Ledger
from stepdeploy.rollout.attempt import Live

_STYLE = {"passed": "green", "failed": "red", "running": "yellow", "stopped": "red", "skipped": "dim",
          "pending": "dim"}


def progress_text(live: Live, now: float) -> str:
    if live.total and live.iteration is not None:
        return f"iteration {live.iteration}/{live.total}"
    if live.deadline:
        return f"{now - live.started:.0f} s of {live.deadline - live.started:.0f} s" + (
            f", iteration {live.iteration}" if live.iteration is not None else "")
    return f"{now - live.started:.0f} s"


def figures(live: Live) -> str:
    last = live.last
    parts = []
    if last.get("loss") is not None:
        parts.append(f"loss {last['loss']:.4f}")
    if last.get("tokens_per_s"):
        parts.append(f"{last['tokens_per_s']:,.0f} tok/s")
    if last.get("step_time_s"):
        parts.append(f"step {last['step_time_s']:.3f} s")
    if live.goodput is not None:
        parts.append(f"goodput {live.goodput:.0%}")
    return ", ".join(parts) or "no step yet"


def rank_figures(live: Live, rank: int) -> tuple[str, str]:
    """(last step time, GPU memory) of a rank from the latest metrics line: every rank's step time is in it;
    memory is rank 0's (the engines record it there; CPU runs have none)."""
    steps = live.last.get("rank_step_time_s") or []
    step = f"{steps[rank]:.3f} s" if rank < len(steps) and steps[rank] is not None else ""
    memory = live.last.get("mem_allocated_gib") if rank == 0 else None
    return step, "" if memory is None else f"{memory:.1f} GiB"


def render(ledger: Ledger, run_id: str, live: Live, now: float) -> Group:
    stages = Table(box=None, pad_edge=False, title=f"rollout {run_id}", title_justify="left")
    for col in ("stage", "status", "detail"):
        stages.add_column(col)
    for s in ledger.stages(run_id):
        detail = ""
        if s.name == live.stage and s.status == "running":
            detail = f"{live.rung}: {progress_text(live, now)} — {figures(live)}"
        stages.add_row(s.name, Text(s.status, style=_STYLE.get(s.status, "")), detail or (s.reason or ""))
    nodes = Table(box=None, pad_edge=False)
    for col in ("node", "state", "rank", "iteration", "heartbeat age", "last step", "GPU memory"):
        nodes.add_column(col)
    for n in live.status.nodes if live.status else ():
        for r in n.ranks or ():
            age = "" if r.heartbeat_age_s is None else f"{r.heartbeat_age_s:.0f} s"
            nodes.add_row(n.node, n.state, str(r.rank), str(r.iteration or ""), age, *rank_figures(live, r.rank))
        if not n.ranks:
            nodes.add_row(n.node, n.state, "", "", "", "", "")
    feed = [Text(f"· {e['message']}") for e in ledger.events(run_id)[-6:]]
    return Group(stages, nodes, *feed)


class PlainReporter:
    """Non-TTY output: every new ledger event as a line, plus a progress line at most every `every_s`."""

    def __init__(self, ledger: Ledger, run_id: str, console: Console, every_s: float = 10.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.ledger, self.run_id, self.console, self.every_s, self.clock = ledger, run_id, console, every_s, clock
        self.seen, self.last_line = 0, 0.0

    def __call__(self, live: Live) -> None:
        self.flush_events()
        now = self.clock()
        if now - self.last_line >= self.every_s:
            self.last_line = now
            self.console.print(f"{live.stage}/{live.rung}: {progress_text(live, now)} — {figures(live)}",
                               markup=False, highlight=False)

    def flush_events(self) -> None:
        for e in self.ledger.events(self.run_id, since_id=self.seen):
            self.seen = e["id"]
            self.console.print(f"[{time.strftime('%H:%M:%S', time.localtime(e['ts']))}] {e['message']}",
                               markup=False, highlight=False)
