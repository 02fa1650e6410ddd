"""The scripted nodes of one run (stepdeploy.testing): what the workload writes, advanced on a fake clock."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepdeploy.monitor.diagnose import ATTEMPT_MARKER
from stepdeploy.remote.executor import EXITED, RUNNING, UNREACHABLE, NodeStatus, RankStatus
from stepdeploy.render.manifest import Manifest
from stepdeploy.rollout.clock import Clock
from stepdeploy.testing.executor import FakeExecutor, FakeTarget, RunSpec


class FakeClock:
    """Time that moves only when something sleeps (or a test calls `advance`)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    advance = sleep

    @property
    def clock(self) -> Clock:
        return Clock(self.time, self.sleep)


@dataclass(frozen=True)
class Fault:
    start: int  # which start of the workload it hits (1-based)
    after_s: float  # seconds after that start
    kind: str  # kill | hang | exit | unreachable
    rank: int | None = None
    node: str | None = None
    for_s: float = 0.0  # unreachable: how long
    code: int = 1  # exit: the rank's exit code
    line: str = ""  # exit: what the rank writes to its node's log (and its status reason)


@dataclass
class _Rank:
    rank: int
    node: str
    pid: int
    state: str = RUNNING  # running | exited | died
    code: int | None = None
    reason: str = ""


@dataclass
class _Start:
    number: int
    at: float
    resumed_from: int
    ranks: list[_Rank]
    frozen_at: float | None = None  # when it stopped making progress (a fault, a stop)
    done: int = 0  # the last iteration written
    beat: float | None = None  # the last heartbeat's time
    active: bool = True  # its processes run (some may be dead or stopped)
    faults: list[Fault] = field(default_factory=list)
    spec: RunSpec = field(default_factory=lambda: RunSpec(""))  # the rendered run it is a start of


class FakeNodes:
    """The nodes of one run, scripted; `executor` is the factory a Rollout takes (`executors=`)."""

    def __init__(self, clock: FakeClock, nodes: tuple[str, ...] = ("node1", "node2"), *, ranks_per_node: int = 1,
                 step_s: float = 1.0, startup_s: float = 3.0, save_every: int = 5) -> None:
        self.clock, self.nodes, self.ranks_per_node = clock, nodes, ranks_per_node
        self.step_s, self.startup_s, self.save_every = step_s, startup_s, save_every
        self.metrics: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []
        self.logs: dict[str, list[str]] = {n: [] for n in nodes}
        self.starts: list[_Start] = []
        self.committed = 0  # the last checkpoint's iteration
        self.calls: list[str] = []  # "prepare", "start", "poll", ... in order
        self.commands: list[tuple[str, str]] = []  # (node, command) of every run_command
        self.faults: list[Fault] = []
        self.down: dict[str, tuple[float, float]] = {}  # node -> (from, until): unreachable
        self._failures: list[tuple[str, str, str]] = []  # (call, node, detail), consumed in order
        self._responses: list[tuple[re.Pattern[str], bool, str]] = []
        self._left: dict[str, tuple[int, ...]] = {}
        self._hooks: list[tuple[str, Callable[[], None]]] = []

    # --- scripting ---------------------------------------------------------------------------------------------
    def at(self, *, start: int, after_s: float, kill: int | None = None, hang: int | None = None,
           exit_rank: int | None = None, code: int = 1, line: str = "", unreachable: str | None = None,
           for_s: float = 0.0) -> None:
        """One fault, `after_s` into the `start`-th start of the workload."""
        if kill is not None:
            self.faults.append(Fault(start, after_s, "kill", rank=kill))
        elif hang is not None:
            self.faults.append(Fault(start, after_s, "hang", rank=hang))
        elif exit_rank is not None:
            self.faults.append(Fault(start, after_s, "exit", rank=exit_rank, code=code, line=line))
        elif unreachable is not None:
            self.faults.append(Fault(start, after_s, "unreachable", node=unreachable, for_s=for_s))

    def fail(self, call: str, node: str, detail: str, times: int = 1) -> None:
        """The next `times` calls of `call` (prepare, start, stop, fetch, run_command) fail on `node`."""
        self._failures += [(call, node, detail)] * times

    def respond(self, pattern: str, stdout: str, ok: bool = True) -> None:
        """run_command: a command matching `pattern` (a regex) answers `stdout` on every node."""
        self._responses.append((re.compile(pattern), ok, stdout))

    def on(self, call: str, action: Callable[[], None], nth: int = 1) -> None:
        """Run `action` just before the `nth` next call of `call` (e.g. write RUN/STOP when the recovery stops
        the run: a `rollout stop` during a restart)."""
        self._hooks += [(call, lambda: None)] * (nth - 1) + [(call, action)]

    def called(self, call: str) -> None:
        self.calls.append(call)
        hook = next((i for i, (c, _a) in enumerate(self._hooks) if c == call), None)
        if hook is not None:
            self._hooks.pop(hook)[1]()

    def stop_leaves(self, node: str, pids: tuple[int, ...]) -> None:
        """The next stop leaves these processes on `node` (the stop failed)."""
        self._left[node] = pids

    def executor(self, cluster: Any = None, local: Path | None = None) -> FakeExecutor:
        """The executor of the run rendered in `local` (its manifest names the nodes), as attempt.executor_for."""
        targets, spec = [FakeTarget(n, f"nodes/{i}-{n}") for i, n in enumerate(self.nodes, 1)], RunSpec("fake-run")
        if local is not None and (local / "manifest.json").exists():
            manifest = Manifest.load(local)
            targets = [FakeTarget(n.name, n.dir) for n in manifest.nodes]
            spec = RunSpec.of(local, manifest.run_id)
        return FakeExecutor(self, targets, spec)

    # --- the world on the clock ---------------------------------------------------------------------------------
    @property
    def current(self) -> _Start | None:
        return self.starts[-1] if self.starts else None

    def unreachable(self, node: str) -> bool:
        window = self.down.get(node)
        return window is not None and window[0] <= self.clock.time() < window[1]

    def advance(self) -> None:
        """Write what the run did up to now: iterations, saves, heartbeats; faults fire at their time."""
        run = self.current
        if run is None or not run.active:
            return
        for fault in sorted((f for f in run.faults), key=lambda f: f.after_s):
            if run.at + fault.after_s > self.clock.time():
                break
            run.faults.remove(fault)
            self._train_until(run, run.at + fault.after_s)
            self._fire(run, fault)
        self._train_until(run, self.clock.time())

    def _train_until(self, run: _Start, when: float) -> None:
        end = min(when, run.frozen_at if run.frozen_at is not None else when)
        first = run.at + self.startup_s
        while run.active:
            iteration = run.done + 1
            t = first + (iteration - run.resumed_from) * self.step_s
            if t > end:
                return
            run.done, run.beat = iteration, t
            if iteration == run.resumed_from + 1:
                self._phase("first_step", t, run, iteration=iteration, step_s=self.step_s)
            self.metrics.append(self._metrics_line(run, iteration, t))
            if iteration % self.save_every == 0 or iteration == run.spec.iterations:
                self.committed = iteration
                self._phase("save", t, run, iteration=iteration, began=t - 0.01)
            if iteration == run.spec.iterations:  # the last: every rank exits 0
                for r in run.ranks:
                    r.state, r.code = (EXITED, 0) if r.state == RUNNING else (r.state, r.code)
                run.frozen_at, run.active = t, False

    def _metrics_line(self, run: _Start, iteration: int, t: float) -> dict[str, Any]:
        """What rank 0 writes for an iteration: a falling loss, a steady step, 128 tokens a second per rank."""
        line = {"iteration": iteration, "time": t, "loss": round(4.0 / (1 + iteration / 50), 5), "grad_norm": 1.0,
                "lr": 3e-3, "step_time_s": self.step_s, "tokens_per_s": 128 * len(run.ranks) / self.step_s,
                "rank_step_time_s": [self.step_s] * len(run.ranks)}
        if run.spec.moe:
            line |= {"moe_load_max": 1.2, "moe_load_ceiling": 4.0, "moe_dropped": 0.0}
        if run.spec.expert_bias:
            line["router_bias_absmax"] = 0.001
        return line

    def _phase(self, name: str, when: float, run: _Start, **data: Any) -> None:
        self.phases.append({"phase": name, "time": when, "pid": run.ranks[0].pid, **data})

    def _fire(self, run: _Start, fault: Fault) -> None:
        when = run.at + fault.after_s
        run.frozen_at = when if run.frozen_at is None else run.frozen_at
        if fault.kind == "unreachable" and fault.node:
            self.down[fault.node] = (when, when + fault.for_s)
            for r in run.ranks:
                if r.node == fault.node and r.state == RUNNING:
                    r.state = "died"
            return
        rank = next(r for r in run.ranks if r.rank == fault.rank)
        if fault.kind == "kill" and rank.state == RUNNING:
            rank.state = "died"
        elif fault.kind == "exit" and rank.state == RUNNING:
            rank.state, rank.code, rank.reason = EXITED, fault.code, fault.line
            self.logs[rank.node].append(f"[rank {rank.rank}] {fault.line}")

    def signal(self, pid: int, sig: str) -> bool:
        run = self.current
        rank = next((r for r in run.ranks if r.pid == pid), None) if run and run.active else None
        if rank is None or rank.state != RUNNING:
            return False
        self.advance()
        run.faults.append(Fault(run.number, self.clock.time() - run.at, "kill" if sig == "9" else "hang",
                                rank=rank.rank))
        self.advance()
        return True

    # --- what the calls do --------------------------------------------------------------------------------------
    def take_failure(self, call: str, node: str) -> str | None:
        for i, (c, n, detail) in enumerate(self._failures):
            if c == call and n == node:
                del self._failures[i]
                return detail
        return None

    def begin(self, spec: RunSpec | None = None, nodes: list[str] | None = None) -> None:
        """A start of the workload on `nodes` (default: all): of the same run as the last start (a restart resumes
        from its last checkpoint), or of another (a new rendering: it starts from scratch)."""
        spec = spec or RunSpec("fake-run")
        if self.starts and spec.run_id != self.starts[-1].spec.run_id:
            self.metrics, self.phases, self.committed = [], [], 0
            self.logs = {n: [] for n in self.nodes}
        number = len(self.starts) + 1
        ranks = [_Rank(i * self.ranks_per_node + k, n, 1000 * number + i * self.ranks_per_node + k)
                 for i, n in enumerate(nodes or self.nodes) for k in range(self.ranks_per_node)]
        run = _Start(number, self.clock.time(), self.committed, ranks, done=self.committed,
                     faults=[f for f in self.faults if f.start == number], spec=spec)
        self.starts.append(run)
        self._phase("start", run.at, run)
        self._phase("resumed", run.at + self.startup_s, run, iteration=self.committed, load_s=0.01)
        for r in ranks:
            self.logs[r.node].append(f"[rank {r.rank}] " + (f"resumed from checkpoint {self.committed}"
                                                            if self.committed else "starting from scratch"))

    def halt(self, nodes: list[str]) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """Stop the run's processes on `nodes`: (killed pids, pids left) per node."""
        self.advance()
        run, killed = self.current, {n: () for n in nodes}
        if run is not None and run.active:
            run.frozen_at = self.clock.time() if run.frozen_at is None else run.frozen_at
            for r in run.ranks:
                if r.node in nodes and r.state == RUNNING:
                    r.state, r.code = EXITED, 143
                    killed[r.node] += (r.pid,)
            run.active = any(r.state == RUNNING for r in run.ranks)
        left = {n: self._left.pop(n, ()) for n in nodes}
        return killed, left

    def write_fetched(self, where: Path, node: str, log: str, first: bool) -> None:
        """The files the workload writes on `node` (rank 0's too when `first`), laid out as FabricExecutor.fetch
        brings them back, its log at `log`."""
        run = self.current
        (where / "out" / "status").mkdir(parents=True, exist_ok=True)
        (where / "out" / "heartbeat").mkdir(parents=True, exist_ok=True)
        (where / "logs").mkdir(parents=True, exist_ok=True)
        if first:  # rank 0's files
            (where / "out" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in self.metrics))
            (where / "out" / "phases.jsonl").write_text("".join(json.dumps(p) + "\n" for p in self.phases))
        for r in run.ranks if run else []:
            if r.node != node:
                continue
            (where / "out" / "status" / f"rank{r.rank}.json").write_text(json.dumps(
                {"rank": r.rank, "node": r.node, "pid": r.pid, "state": r.state, "code": r.code, "reason": r.reason}))
            if run.beat is not None:
                (where / "out" / "heartbeat" / f"rank{r.rank}").write_text(
                    json.dumps({"iteration": run.done, "time": run.beat}))
        (where / log).parent.mkdir(parents=True, exist_ok=True)
        (where / log).write_text("".join(line + "\n" for line in self.logs[node]))

    def answer(self, node: str, command: str, first: bool) -> tuple[bool, str]:
        """(ok, stdout) of `command` on `node` (`first`: the run's first node, rank 0's): a `respond`ed pattern,
        else the controller's own commands understood (the latest metrics line, the attempt marker, a signal to a
        rank, an injected kill); anything else succeeds silently."""
        for pattern, ok, stdout in self._responses:
            if pattern.search(command):
                return ok, stdout
        if command.startswith("tail -n 1 out/metrics.jsonl"):
            self.advance()
            return True, json.dumps(self.metrics[-1]) + "\n" if first and self.metrics else ""
        if ATTEMPT_MARKER in command:
            marker = re.search(re.escape(ATTEMPT_MARKER) + r"[^']*", command)
            if self.logs[node] and marker:
                self.logs[node].append(marker.group(0))
            return True, ""
        signal = re.fullmatch(r"kill -0 (\d+) && kill -(9|STOP) \1", command)
        if signal:
            return self.signal(int(signal.group(1)), signal.group(2)), ""
        if "STEPDEPLOY_RUN_ID=" in command and "kill -9" in command:  # a node-loss injection's kill
            self.halt([node])
        return True, ""

    def status(self, node: str) -> NodeStatus:
        run, now = self.current, self.clock.time()
        if self.unreachable(node):
            return NodeStatus(node, UNREACHABLE, detail="TimeoutError: timed out")
        ranks = tuple(RankStatus(r.rank, r.node, r.pid, r.state, r.code, r.reason,
                                 run.done if run.beat else None, round(now - run.beat, 2) if run.beat else None)
                      for r in (run.ranks if run else []) if r.node == node)
        alive = run is not None and run.active and any(r.state == RUNNING for r in ranks)
        if alive:
            return NodeStatus(node, RUNNING, None, ranks, "1 process(es) of the run")
        codes = [r.code for r in ranks if r.code is not None]
        return NodeStatus(node, EXITED, max(codes) if codes else None, ranks, "0 process(es) of the run")
