"""The executor protocol (FabricExecutor's methods) over scripted nodes: the executor answers the controller's
calls and leaves what happens on the nodes to the world it is given (stepdeploy.testing.nodes.FakeNodes, which
makes these executors and so is the one that knows this module, not the other way round)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from stepdeploy.remote.executor import CommandResult, NodeResult, NodeStatus, RunStatus, StopResult
from stepdeploy.render.workload_file import WORKLOAD_FILE, Workload


@dataclass(frozen=True)
class RunSpec:
    """What the rendered run asks of the workload (its workload.json): its iterations (it exits 0 after the last)
    and whether its model has experts (its metrics then carry an expert load, and a router bias with expert-bias
    balancing). An unknown run trains for ever, densely."""

    run_id: str
    iterations: int | None = None
    moe: bool = False
    expert_bias: bool = False

    @classmethod
    def of(cls, local: Path, run_id: str) -> RunSpec:
        """What the rendered run at `local` trains (its workload.json, read typed), or only its id when none."""
        if not (local / WORKLOAD_FILE).is_file():
            return cls(run_id)
        workload = Workload.load(local)
        return cls(run_id, workload.training.iterations, bool(workload.moe),
                   workload.moe.get("load_balancing") == "expert_bias")


class World(Protocol):
    """The scripted nodes an executor drives (FakeNodes): what each call finds there and does to them."""

    logs: dict[str, list[str]]  # each node's log lines
    commands: list[tuple[str, str]]  # (node, command) of every run_command

    def called(self, call: str) -> None: ...

    def unreachable(self, node: str) -> bool: ...

    def take_failure(self, call: str, node: str) -> str | None: ...

    def begin(self, spec: RunSpec | None = None, nodes: list[str] | None = None) -> None: ...

    def advance(self) -> None: ...

    def status(self, node: str) -> NodeStatus: ...

    def halt(self, nodes: list[str]) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]: ...

    def write_fetched(self, where: Path, node: str, log: str, first: bool) -> None: ...

    def answer(self, node: str, command: str, first: bool) -> tuple[bool, str]: ...


@dataclass(frozen=True)
class FakeTarget:
    name: str
    node_dir: str

    @property
    def log(self) -> str:
        return f"logs/{self.node_dir.rsplit('/', 1)[-1]}.log"


class FakeExecutor:
    """The executor protocol (FabricExecutor's methods) over a World (FakeNodes)."""

    poll_interval_s = 2.0  # the scripted timings were written for a 2 s poll (FabricExecutor's until issue 37)

    def __init__(self, nodes: World, targets: list[FakeTarget], spec: RunSpec) -> None:
        self.world, self.targets, self.spec = nodes, targets, spec
        self.run_id, self.run_dir = spec.run_id, f"/fake/{spec.run_id}"

    def __enter__(self) -> FakeExecutor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass

    def _chosen(self, targets: list[Any] | None) -> list[Any]:
        return self.targets if targets is None else targets

    def _answer(self, call: str, node: str) -> str | None:
        """Why `call` fails on `node` now (unreachable or scripted), or None."""
        if self.world.unreachable(node):
            return "unreachable: TimeoutError: timed out"
        return self.world.take_failure(call, node)

    def prepare(self, local_run: Path) -> list[NodeResult]:
        self.world.called("prepare")
        return [NodeResult(t.name, False, why) if (why := self._answer("prepare", t.name)) else
                NodeResult(t.name, True, "uploaded") for t in self.targets]

    def start(self) -> list[NodeResult]:
        self.world.called("start")
        results = [NodeResult(t.name, False, why) if (why := self._answer("start", t.name)) else
                   NodeResult(t.name, True, "launch pid 4242") for t in self.targets]
        if all(r.ok for r in results):
            self.world.begin(self.spec, [t.name for t in self.targets])
        return results

    def poll(self) -> RunStatus:
        self.world.called("poll")
        self.world.advance()
        return RunStatus(tuple(self.world.status(t.name) for t in self.targets))

    def logs(self, tail: int = 50) -> dict[str, list[str]]:
        self.world.called("logs")
        return {t.name: [f"{t.name} | (unreachable)"] if self.world.unreachable(t.name) else
                [f"{t.name} | {line}" for line in self.world.logs[t.name][-tail:]] for t in self.targets}

    def stop(self, grace_s: float = 10.0, targets: list[Any] | None = None) -> list[StopResult]:
        self.world.called("stop")
        chosen = self._chosen(targets)
        failed = {t.name: why for t in chosen if (why := self._answer("stop", t.name))}
        killed, left = self.world.halt([t.name for t in chosen if t.name not in failed])
        return [StopResult(t.name, False, detail=failed[t.name]) if t.name in failed else
                StopResult(t.name, not left[t.name], killed[t.name], killed[t.name], left[t.name],
                           "nothing of the run is left" if not left[t.name] else f"still running: {left[t.name]}")
                for t in chosen]

    def fetch(self, dest: Path) -> list[NodeResult]:
        self.world.called("fetch")
        self.world.advance()
        results = []
        for i, t in enumerate(self.targets):
            if why := self._answer("fetch", t.name):
                results.append(NodeResult(t.name, False, why))
                continue
            self.world.write_fetched(dest / t.node_dir, t.name, t.log, first=i == 0)
            results.append(NodeResult(t.name, True, str(dest / t.node_dir)))
        return results

    def run_command(self, command: str, targets: list[Any] | None = None) -> list[CommandResult]:
        self.world.called("run_command")
        results = []
        for t in self._chosen(targets):
            self.world.commands.append((t.name, command))
            if why := self._answer("run_command", t.name):
                results.append(CommandResult(t.name, False, None, stderr=why))
                continue
            ok, out = self.world.answer(t.name, command, first=t.name == self.targets[0].name)
            results.append(CommandResult(t.name, ok, 0 if ok else 1, out))
        return results
