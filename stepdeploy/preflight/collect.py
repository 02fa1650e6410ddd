"""Running commands on nodes: over SSH (Fabric, host keys verified) or on this machine, all nodes in
parallel, each bounded by a deadline. The only side effects of preflight live here and in `bandwidth`."""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, TypeVar

from stepdeploy.inventory.model import Node
from stepdeploy.preflight import probe
from stepdeploy.preflight.cluster import Probe
from stepdeploy.preflight.model import TIMED_OUT_RC, NodeOutput

T = TypeVar("T")


@dataclass(frozen=True)
class Ran:
    rc: int
    stdout: str
    stderr: str = ""


class Target(Protocol):
    name: str

    def run(self, command: str, timeout_s: float) -> Ran: ...
    def put(self, local: Path, remote: str) -> None: ...
    def close(self) -> None: ...


@dataclass
class LocalTarget:
    """This machine, no SSH (`--local`, or ansible_connection=local)."""

    name: str

    def run(self, command: str, timeout_s: float) -> Ran:
        try:
            res = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=timeout_s,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return Ran(TIMED_OUT_RC, out, f"timed out after {timeout_s:g} s")
        return Ran(res.returncode, res.stdout, res.stderr)

    def put(self, local: Path, remote: str) -> None:
        Path(remote).write_bytes(local.read_bytes())

    def close(self) -> None:
        return None


@dataclass
class SshTarget:
    """One node over SSH; the connection is opened on first use and kept for the later phases."""

    name: str
    endpoint: object  # stepdeploy.remote.ssh.Endpoint
    connect_timeout_s: int = 10
    _conn: object | None = field(default=None, repr=False)

    def _connection(self):
        if self._conn is None:
            from stepdeploy.remote.ssh import connection  # Fabric/paramiko only where SSH is used

            self._conn = connection(self.endpoint, connect_timeout=self.connect_timeout_s)
        return self._conn

    def run(self, command: str, timeout_s: float) -> Ran:
        from invoke.exceptions import CommandTimedOut

        try:
            res = self._connection().run(command, hide=True, warn=True, timeout=timeout_s)
        except CommandTimedOut as exc:
            return Ran(TIMED_OUT_RC, exc.result.stdout, f"timed out after {timeout_s:g} s")
        return Ran(res.exited, res.stdout, res.stderr)

    def put(self, local: Path, remote: str) -> None:
        self._connection().put(str(local), remote)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def target_for(node: Node, *, local: bool, connect_timeout_s: int = 10) -> Target:
    if local or node.ssh.connection == "local":
        return LocalTarget(node.name)
    from stepdeploy.remote.ssh import endpoint_for

    ep = replace(endpoint_for(node), user=node.ssh.user or "root")
    return SshTarget(node.name, ep, connect_timeout_s)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def in_parallel(targets: Sequence[Target], work: Callable[[Target], T], deadline_s: float
                ) -> dict[str, T | BaseException]:
    """work(target) on every target at once; a target still busy at the deadline gets a TimeoutError
    (its thread is abandoned, not waited for: a hung node must not hang preflight)."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(64, len(targets))))
    futures = {t.name: pool.submit(work, t) for t in targets}
    wait(futures.values(), timeout=deadline_s)
    results: dict[str, T | BaseException] = {}
    for name, fut in futures.items():
        if not fut.done():
            fut.cancel()
            results[name] = TimeoutError(f"no answer within {deadline_s:g} s")
        elif fut.exception() is not None:
            results[name] = fut.exception()
        else:
            results[name] = fut.result()
    pool.shutdown(wait=False, cancel_futures=True)
    return results


def probe_node(target: Target, spec: probe.ProbeSpec, timeout_s: float, now: Callable[[], float]) -> NodeOutput:
    started = time.monotonic()
    out = NodeOutput(node=target.name)
    before = now()
    clock = target.run("date +%s.%N", timeout_s)
    after = now()
    if clock.rc == 0:
        try:
            out.clock_skew_s = float(clock.stdout.strip()) - (before + after) / 2
            out.clock_uncertainty_s = (after - before) / 2
        except ValueError:
            pass
    res = target.run(probe.remote_command(spec), timeout_s)
    out.sections = probe.split(res.stdout)
    if not out.sections:
        out.error = f"probe produced no output (exit {res.rc}): {(res.stderr or res.stdout).strip()[-300:]}"
    out.seconds = time.monotonic() - started
    return out


def probe_all(targets: Sequence[Target], specs: dict[str, probe.ProbeSpec], timeout_s: float,
              now: Callable[[], float] = time.time) -> dict[str, NodeOutput]:
    """Run the probe everywhere; unreachable or hung nodes come back as NodeOutput(error=...)."""
    answers = in_parallel(targets, lambda t: probe_node(t, specs[t.name], timeout_s, now), timeout_s + 15)
    outputs = {}
    for name, ans in answers.items():
        outputs[name] = ans if isinstance(ans, NodeOutput) else NodeOutput(node=name, error=_describe(ans))
    return outputs


def reach_command(peers: Sequence[tuple[str, str, int]], timeout_s: int = 3) -> str:
    """Connect from this node to every (name, address, port) at once; one line per peer. Every value is a
    quoted word (names and addresses come from the inventory and the nodes' own answers)."""
    q = shlex.quote
    connect = q('exec 3<>"/dev/tcp/$0/$1"')
    parts = []
    for name, address, port in peers:
        ok, failed = (q(f"reach {name} {address} {word}") for word in ("ok", "fail"))
        parts.append(f"( if timeout {int(timeout_s)} bash -c {connect} {q(address)} {q(str(port))} 2>/dev/null; "
                     f"then echo {ok}; else echo {failed}; fi ) &")
    return " ".join(parts) + " wait"


def parse_reach(source: str, stdout: str) -> list[Probe]:
    probes = []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "reach":
            probes.append(Probe(source, parts[1], parts[2], parts[3] == "ok",
                                "" if parts[3] == "ok" else "TCP connect failed"))
    return probes


def reach_all(targets: Sequence[Target], addresses: dict[str, tuple[str, int]], timeout_s: float) -> list[Probe]:
    """Every node connects to every other node's training address (TCP, the SSH port)."""
    def one(t: Target) -> list[Probe]:
        peers = [(n, a, p) for n, (a, p) in addresses.items() if n != t.name]
        res = t.run(reach_command(peers), timeout_s)
        got = parse_reach(t.name, res.stdout)
        missing = {n for n, _, _ in peers} - {p.target for p in got}
        return got + [Probe(t.name, n, addresses[n][0], False, "no answer") for n in sorted(missing)]

    answers = in_parallel(targets, one, timeout_s + 5)
    probes: list[Probe] = []
    for name, ans in answers.items():
        if isinstance(ans, BaseException):
            probes += [Probe(name, n, a, False, _describe(ans)) for n, (a, _) in addresses.items() if n != name]
        else:
            probes += ans
    return probes
