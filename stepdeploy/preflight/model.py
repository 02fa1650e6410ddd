"""Values preflight passes around: a check's result, a node's collected outputs, the whole report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum

from stepdeploy.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"  # does not apply here (no GPUs, no InfiniBand) or was not asked for

    @property
    def symbol(self) -> str:
        return {"ok": "✔", "warn": "⚠", "fail": "✘", "skip": "-"}[self.value]


@dataclass(frozen=True)
class Result:
    """One check on one node (node=None: a cross-node check). `fix` says what to do when it is not ok."""

    check: str
    status: Status
    observed: str
    expected: str = ""
    fix: str = ""
    node: str | None = None

    def on(self, node: str) -> Result:
        return Result(self.check, self.status, self.observed, self.expected, self.fix, node)

    def to_json(self) -> dict:
        data = asdict(self)
        data["status"] = self.status.value
        return data


def ok(check: str, observed: str, expected: str = "") -> Result:
    return Result(check, Status.OK, observed, expected)


def warning(check: str, observed: str, expected: str, fix: str) -> Result:
    return Result(check, Status.WARN, observed, expected, fix)


def fail(check: str, observed: str, expected: str, fix: str) -> Result:
    return Result(check, Status.FAIL, observed, expected, fix)


def skip(check: str, why: str) -> Result:
    return Result(check, Status.SKIP, why)


@dataclass(frozen=True)
class Section:
    """What one probe command printed (stdout and stderr together) and its exit status."""

    rc: int
    text: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


TIMED_OUT_RC = 124  # coreutils `timeout`


@dataclass
class NodeOutput:
    """Everything collected from one node. `error` set: the node could not be reached or did not answer."""

    node: str
    sections: dict[str, Section] = field(default_factory=dict)
    error: str | None = None
    clock_skew_s: float | None = None  # node clock minus controller clock
    clock_uncertainty_s: float | None = None  # half the round trip of the clock probe
    seconds: float = 0.0

    def get(self, name: str) -> Section:
        return self.sections.get(name, Section(rc=127, text=f"{name}: not collected"))


@dataclass
class Report:
    nodes: list[str]
    results: list[Result]
    unreachable: dict[str, str] = field(default_factory=dict)  # node -> why
    bandwidth: list[dict] = field(default_factory=list)  # the sweep's rows (rank 0's view)
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        if self.unreachable:
            return EXIT_UNREACHABLE
        if any(r.status is Status.FAIL for r in self.results):
            return EXIT_FAILED
        return EXIT_OK

    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status in (Status.FAIL, Status.WARN)]

    def result(self, check: str, node: str | None = None) -> Result | None:
        return next((r for r in self.results if r.check == check and r.node == node), None)

    def to_json(self) -> dict:
        counts = {s.value: sum(r.status is s for r in self.results) for s in Status}
        return {
            "exit_code": self.exit_code, "nodes": self.nodes, "unreachable": self.unreachable,
            "counts": counts, "seconds": round(self.seconds, 3),
            "results": [r.to_json() for r in self.results], "bandwidth": self.bandwidth,
        }
