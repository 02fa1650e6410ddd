"""Provisioning progress as data: ansible-runner events in, per-host state out (pure, no I/O).

The live view, the plain line-per-event output and the recap are all renderings of this state, so they
can be tested by feeding recorded events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RESULT_EVENTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_skipped": "skipped",
    "runner_on_unreachable": "unreachable",
}


@dataclass
class Failure:
    host: str
    task: str
    message: str


@dataclass
class HostState:
    name: str
    task: str = ""
    ok: int = 0
    changed: int = 0
    failed: int = 0
    skipped: int = 0
    ignored: int = 0
    unreachable: bool = False
    done: bool = False

    @property
    def status(self) -> str:
        if self.unreachable:
            return "unreachable"
        if self.failed:
            return "failed"
        return "done" if self.done else "running"


@dataclass
class Progress:
    hosts: dict[str, HostState] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    play: str = ""
    plays: int = 0
    tasks: int = 0
    finished: bool = False

    def host(self, name: str) -> HostState:
        return self.hosts.setdefault(name, HostState(name))

    def handle(self, event: dict[str, Any]) -> str | None:
        """Fold one ansible-runner event into the state; return a plain one-line description, if any."""
        kind = event.get("event", "")
        data = event.get("event_data", {}) or {}
        if kind == "playbook_on_play_start":
            self.play, self.plays = data.get("play", ""), self.plays + 1
            return f"PLAY {self.play}"
        if kind == "playbook_on_task_start":
            self.tasks += 1
            return None
        if kind == "runner_on_start":
            self.host(data.get("host", "?")).task = _task_name(data)
            return None
        if kind in RESULT_EVENTS:
            return self._result(RESULT_EVENTS[kind], data)
        if kind == "playbook_on_stats":
            self.finished = True
            for state in self.hosts.values():
                state.done = True
        return None

    def _result(self, outcome: str, data: dict[str, Any]) -> str:
        name = data.get("host", "?")
        state, task, res = self.host(name), _task_name(data), data.get("res", {}) or {}
        state.task = task
        if outcome == "failed" and data.get("ignore_errors"):
            state.ignored += 1
            outcome = "ignored"
        elif outcome == "failed":
            state.failed += 1
            self.failures.append(Failure(name, task, _message(res)))
        elif outcome == "unreachable":
            state.unreachable = True
            self.failures.append(Failure(name, task, _message(res)))
        elif outcome == "skipped":
            state.skipped += 1
        else:
            state.ok += 1
            if res.get("changed"):
                state.changed += 1
                outcome = "changed"
        return f"{name:<12} {outcome:<11} {task}"

    @property
    def any_unreachable(self) -> bool:
        return any(h.unreachable for h in self.hosts.values())

    @property
    def any_failed(self) -> bool:
        return any(h.failed for h in self.hosts.values())

    def summary(self) -> dict[str, Any]:
        return {
            "hosts": {h.name: {"ok": h.ok, "changed": h.changed, "failed": h.failed, "skipped": h.skipped,
                               "ignored": h.ignored, "unreachable": h.unreachable, "status": h.status}
                      for h in self.hosts.values()},
            "failures": [f.__dict__ for f in self.failures],
            "plays": self.plays,
            "tasks": self.tasks,
        }


def _task_name(data: dict[str, Any]) -> str:
    task = data.get("task", "") or ""
    role = data.get("role")
    return f"{role} : {task}" if role and not task.startswith(f"{role} :") else task


def _message(res: dict[str, Any]) -> str:
    msg = res.get("msg") or res.get("stderr") or res.get("module_stderr") or res.get("reason") or ""
    if isinstance(msg, list):
        msg = "; ".join(str(m) for m in msg)
    lines = [" ".join(line.split()) for line in str(msg).splitlines()]
    return "\n".join(line for line in lines if line)[:2000]
