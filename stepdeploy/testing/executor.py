"""The executor protocol (FabricExecutor's methods) over scripted nodes (stepdeploy.testing.nodes)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepdeploy.monitor.diagnose import ATTEMPT_MARKER
from stepdeploy.remote.executor import CommandResult, NodeResult, RunStatus, StopResult

if TYPE_CHECKING:
    from stepdeploy.testing.nodes import FakeNodes, RunSpec


@dataclass(frozen=True)
class FakeTarget:
    name: str
    node_dir: str

    @property
    def log(self) -> str:
        return f"logs/{self.node_dir.rsplit('/', 1)[-1]}.log"


class FakeExecutor:
    """The executor protocol (FabricExecutor's methods) over FakeNodes."""

    poll_interval_s = 2.0  # FabricExecutor's: the scripted timings are on the SSH executors' polls

    def __init__(self, nodes: FakeNodes, targets: list[FakeTarget], spec: RunSpec) -> None:
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
            self._write(dest / t.node_dir, t, first=i == 0)
            results.append(NodeResult(t.name, True, str(dest / t.node_dir)))
        return results

    def _write(self, where: Path, target: FakeTarget, first: bool) -> None:
        """The files the workload writes, laid out as FabricExecutor.fetch brings them back."""
        world, run = self.world, self.world.current
        (where / "out" / "status").mkdir(parents=True, exist_ok=True)
        (where / "out" / "heartbeat").mkdir(parents=True, exist_ok=True)
        (where / "logs").mkdir(parents=True, exist_ok=True)
        if first:  # rank 0's files
            (where / "out" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in world.metrics))
            (where / "out" / "phases.jsonl").write_text("".join(json.dumps(p) + "\n" for p in world.phases))
        for r in run.ranks if run else []:
            if r.node != target.name:
                continue
            (where / "out" / "status" / f"rank{r.rank}.json").write_text(json.dumps(
                {"rank": r.rank, "node": r.node, "pid": r.pid, "state": r.state, "code": r.code, "reason": r.reason}))
            if run.beat is not None:
                (where / "out" / "heartbeat" / f"rank{r.rank}").write_text(
                    json.dumps({"iteration": run.done, "time": run.beat}))
        (where / target.log).parent.mkdir(parents=True, exist_ok=True)
        (where / target.log).write_text("".join(line + "\n" for line in world.logs[target.name]))

    def run_command(self, command: str, targets: list[Any] | None = None) -> list[CommandResult]:
        self.world.called("run_command")
        results = []
        for t in self._chosen(targets):
            self.world.commands.append((t.name, command))
            if why := self._answer("run_command", t.name):
                results.append(CommandResult(t.name, False, None, stderr=why))
                continue
            ok, out = self._run(t, command)
            results.append(CommandResult(t.name, ok, 0 if ok else 1, out))
        return results

    def _run(self, target: FakeTarget, command: str) -> tuple[bool, str]:
        world = self.world
        for pattern, ok, stdout in world._responses:
            if pattern.search(command):
                return ok, stdout
        if command.startswith("tail -n 1 out/metrics.jsonl"):
            world.advance()
            first = target.name == self.targets[0].name
            return True, json.dumps(world.metrics[-1]) + "\n" if first and world.metrics else ""
        if ATTEMPT_MARKER in command:
            marker = re.search(re.escape(ATTEMPT_MARKER) + r"[^']*", command)
            if world.logs[target.name] and marker:
                world.logs[target.name].append(marker.group(0))
            return True, ""
        signal = re.fullmatch(r"kill -0 (\d+) && kill -(9|STOP) \1", command)
        if signal:
            return world.signal(int(signal.group(1)), signal.group(2)), ""
        if "STEPDEPLOY_RUN_ID=" in command and "kill -9" in command:  # a node-loss injection's kill
            world.halt([target.name])
            return True, ""
        return True, ""
