"""The executor that drives a rendered run through a shell on every node: what the fabric (SSH) and the local
(this machine) executors share; each node is reached through its transport channel, all nodes in parallel,
every answer per node, every command under its own deadline and every call under one for all nodes.

prepare  uploads the run directory as one tarball, unpacks it beside the target, checks every file's sha256
         and renames it into place: a node has the whole run directory or none of it; a node whose run directory
         holds the same rendering already (a soak's restart) gets nothing (remote/upload.py).
start    `setsid nohup` the node's launch.sh: it leads a session and process group of its own, writes its
         pid file, and outlives the channel's session and the controller. If a node cannot be started, the
         nodes that did start are stopped (never left running alone).
poll     node_probe.py on every node, each bounded by POLL_TIMEOUT_S (connecting included) and the round by
         POLL_DEADLINE_S: a node whose link went silent is answered unreachable within seconds (with how long it
         has been silent) while the other nodes' answers come back, and until a poll reaches it again the
         commands, logs and follows of the run do not wait on it (answered unreachable at once, not tried).
stop     SIGTERM to the launch group and to every process carrying the run's STEPDEPLOY_RUN_ID, grace,
         SIGKILL, then list what is left (node_probe.py); a node is ok only when nothing is.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import shlex
import time
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import TypeVar

from stepdeploy import noderecords
from stepdeploy.remote import poll_answer, safe_extract, upload
from stepdeploy.remote.executor import (
    UNREACHABLE,
    CommandResult,
    LogCursor,
    NodeResult,
    NodeStatus,
    RunStatus,
    StopResult,
    Target,
)
from stepdeploy.remote.transport import CALL_TIMEOUT_S, Channel, Ran, TooLarge, each
from stepdeploy.render.manifest import Manifest

T = TypeVar("T")
PROBE = resources.files("stepdeploy.remote").joinpath("node_probe.py").read_text()
q = shlex.quote
DEADLINE_S = 3 * CALL_TIMEOUT_S + 30  # one call on all nodes (an upload is three commands and a transfer)
POLL_TIMEOUT_S = 10.0  # one node's poll, connecting included (the watchdog in transport.SshChannel ends it)
POLL_DEADLINE_S = POLL_TIMEOUT_S + 5  # one poll round on all nodes: a silent node never holds it longer
FOLLOW_CHUNK_BYTES = 4 * 1024 * 1024  # of one node's log per follow call (the rest comes with the next)
MAX_LOG_LINE_BYTES = 64 * 1024  # a longer line is emitted in pieces of this size


class ProbeFailed(RuntimeError):
    """The node answered, but its probe exited non-zero."""


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


class NodeExecutor:
    kind = "nodes"
    python = "python3"  # the nodes' interpreter for node_probe.py (standard library only)
    one_machine = False  # every target is the same machine (the local executor)
    # How often a rollout polls the run (RolloutConfig.poll_interval_s overrides). A crash is seen at the first poll
    # after it; issue 37 asks for detection over SSH within 1 s. One poll (the probe on every node over its kept SSH
    # connection, all at once) measured 58-67 ms median, 76-87 ms p90 (81-131 and 389-537 ms on a loaded host),
    # ~6.5 ms of the controller's CPU and ~20 ms of each node's, on the 2-node simulated cluster; a kill was detected
    # in 0.7 s polling every 0.5 s against 2.3 s every 2 s (bench/fault_matrix.py --only kill [--poll-interval 2]).
    poll_interval_s = 0.5
    fetch_limits = safe_extract.Limits()  # what one node may send back to `fetch` (sizes, entries)

    def __init__(self, run_id: str, run_dir: str, targets: Iterable[Target]) -> None:
        self.run_id, self.run_dir = run_id, run_dir
        self.targets = list(targets)
        self._silent_since: dict[str, float] = {}  # node -> when a poll first found it silent (monotonic)

    # -- plumbing -------------------------------------------------------------------------------------------
    def _each(self, work: Callable[[Target], T], failed: Callable[[Target, BaseException], T],
              targets: list[Target] | None = None, deadline_s: float = DEADLINE_S) -> list[T]:
        """`work` on every node in parallel; an exception (a node past the deadline included) becomes that
        node's `failed` answer. Answers come in the targets' order."""
        chosen = self.targets if targets is None else targets
        answers = each(chosen, work, deadline_s)
        results = []
        for target in chosen:
            answer = answers[target.name]
            if isinstance(answer, BaseException):  # any SSH/socket failure is this node's answer, not everyone's
                target.channel.close()
                answer = failed(target, answer)
            results.append(answer)
        return results

    def _heard(self, target: Target) -> None:
        self._silent_since.pop(target.name, None)

    def _reachable(self, targets: list[Target] | None) -> list[Target]:
        """The targets a poll has not found silent since it last reached them."""
        return [t for t in (self.targets if targets is None else targets) if t.name not in self._silent_since]

    def _each_reachable(self, work: Callable[[Target], T], failed: Callable[[Target, BaseException], T],
                    silent: Callable[[Target, str], T], targets: list[Target] | None = None) -> list[T]:
        """`_each` on the targets a poll has not found silent; a silent one is not tried and answers `silent(target,
        why)`. Answers come in the targets' order."""
        chosen = self.targets if targets is None else targets
        tried = self._reachable(chosen)
        answers = dict(zip((t.name for t in tried), self._each(work, failed, tried), strict=True))
        return [answers[t.name] if t.name in answers else silent(t, self._silent(t)) for t in chosen]

    def _silent(self, target: Target) -> str:
        since = self._silent_since[target.name]
        return f"unreachable: silent for {time.monotonic() - since:.0f} s (no answer to the last poll); not tried"

    def _sh(self, target: Target, command: str, timeout: float | None = CALL_TIMEOUT_S) -> Ran:
        ran = target.channel.run(command, timeout)
        if ran.timed_out:
            raise TimeoutError(f"no answer within {timeout:g} s")
        return ran

    def close(self) -> None:
        for target in self.targets:
            target.channel.close()

    def __enter__(self) -> NodeExecutor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- protocol -------------------------------------------------------------------------------------------
    def describe(self, local_run: Path) -> list[str]:
        return [f"{t.name} ({t.channel.where}): upload {local_run} to {self.run_dir}, start setsid nohup bash "
                f"{t.node_dir}/launch.sh" for t in self.targets]

    def prepare(self, local_run: Path) -> list[NodeResult]:
        """Every node answers first (its host key verified, its shell running), saying whether its run directory
        holds this rendering already (a restart's case: remote/upload.py); a node that does not answer leaves every
        node as it was. The others get the upload."""
        digest = upload.manifest_digest(local_run)

        def check(target: Target) -> NodeResult:
            return upload.check(lambda command: self._sh(target, command), target.name, self.run_dir, digest)

        answers = self._each(check, lambda t, e: NodeResult(t.name, False, f"unreachable: {_error(e)}"))
        bad = [a for a in answers if not a.ok]
        if bad:
            names = ", ".join(a.node for a in bad)
            return [a if not a.ok else NodeResult(a.node, False, f"nothing written: {names} could not be reached")
                    for a in answers]
        missing = [t for t, a in zip(self.targets, answers, strict=True) if a.detail != upload.THERE]
        if not missing:
            return answers
        payload = upload.tarball(local_run)
        tag = hashlib.sha256(payload).hexdigest()[:16]

        def work(target: Target) -> NodeResult:
            return upload.upload(lambda command: self._sh(target, command), target, self.run_dir, payload, tag)

        def failed(target: Target, exc: BaseException) -> NodeResult:
            return NodeResult(target.name, False, f"unreachable: {_error(exc)}")

        if self.one_machine:  # every node is this machine, in one run directory: one upload at a time
            done = [result for target in missing for result in self._each(work, failed, [target])]
        else:
            done = self._each(work, failed, missing)
        uploaded = {r.node: r for r in done}
        return [uploaded.get(a.node, a) for a in answers]

    def start(self) -> list[NodeResult]:
        results = self._each(self._start_one, lambda t, e: NodeResult(t.name, False, f"unreachable: {_error(e)}"))
        if not all(r.ok for r in results):
            started = [t for t, r in zip(self.targets, results, strict=True) if r.ok]
            stops = self.stop(targets=started)
            results = [r if not r.ok else NodeResult(r.node, False, "stopped again: another node failed to start")
                       for r in results]
            results += [NodeResult(s.node, s.ok, f"stop: {s.detail}") for s in stops if not s.ok]
        return results

    def _start_one(self, target: Target) -> NodeResult:
        run, node_dir = q(self.run_dir), q(target.node_dir)
        # The `&` must apply to setsid alone: a backgrounded `a && b &` list is a subshell that keeps the
        # SSH channel open until the run ends.
        launch = (f"cd -- {run} && mkdir -p logs && rm -f -- {node_dir}/launch.pid {node_dir}/exit_code || exit 1; "
                  f"setsid nohup env STEPDEPLOY_RUN_ID={q(self.run_id)} bash {node_dir}/launch.sh "
                  f">> {q(target.log)} 2>&1 < /dev/null & "
                  f"for _ in $(seq 250); do [ -s {run}/{node_dir}/launch.pid ] && break; sleep 0.02; done; "
                  f"cat {run}/{node_dir}/launch.pid")
        res = self._sh(target, launch)
        pid = res.stdout.strip()
        if not res.ok or not pid.isdigit():
            return NodeResult(target.name, False, f"did not start: {res.stderr.strip()[-300:]}")
        return NodeResult(target.name, True, f"launch pid {pid}")

    def _probe(self, target: Target, mode: str, *extra: str, timeout: float = CALL_TIMEOUT_S) -> str:
        """The probe's answer (its stdout: the node's word, checked by the caller)."""
        args = " ".join(q(a) for a in (mode, self.run_dir, self.run_id, target.node_dir, *extra))
        # -I: nothing from the working directory, PYTHONPATH or user site-packages is imported as root
        res = self._sh(target, f"{q(self.python)} -I -c {q(PROBE)} {args}", timeout=timeout)
        if not res.ok:
            raise ProbeFailed(f"probe failed: {res.stderr.strip()[-300:]}")
        return res.stdout

    def poll(self) -> RunStatus:
        """Every node's status; one that does not answer within POLL_TIMEOUT_S is UNREACHABLE, with `silent_s`
        (how long it has not answered a poll) and its detail saying so."""
        def one(target: Target) -> NodeStatus:
            try:
                answer = self._probe(target, "poll", timeout=POLL_TIMEOUT_S)
            except ProbeFailed:  # the node answered (its python3 did not): not silent
                self._heard(target)
                raise
            self._heard(target)
            return poll_answer.node_status(target.name, answer)

        def failed(target: Target, exc: BaseException) -> NodeStatus:
            if isinstance(exc, ProbeFailed):
                return NodeStatus(target.name, UNREACHABLE, detail=_error(exc))
            since = self._silent_since.setdefault(target.name, time.monotonic())
            silent = round(time.monotonic() - since, 1)
            return NodeStatus(target.name, UNREACHABLE, detail=f"{_error(exc)} (silent for {silent:.0f} s)",
                              silent_s=silent)

        return RunStatus(tuple(self._each(one, failed, deadline_s=POLL_DEADLINE_S)))

    def logs(self, tail: int = 50) -> dict[str, list[str]]:
        def one(target: Target) -> list[str]:
            res = self._sh(target, f"tail -n {int(tail)} -- {q(self.run_dir)}/{q(target.log)}")
            return [f"{target.name} | {line}" for line in res.stdout.splitlines()]

        answers = self._each_reachable(one, lambda t, e: [f"{t.name} | (unreachable: {_error(e)})"],
                                   lambda t, why: [f"{t.name} | ({why})"])
        return {t.name: lines for t, lines in zip(self.targets, answers, strict=True)}

    def follow(self, emit: Callable[[str], None], cursor: LogCursor) -> list[NodeResult]:
        """Emit every complete log line added since `cursor`, prefixed with the node's name; call repeatedly.
        The log comes as bytes (base64), so the cursor counts what the node wrote; bytes that are not UTF-8
        show as replacement characters and never shift or swallow the text after them."""

        def one(target: Target) -> NodeResult:
            offset = cursor.offsets.get(target.name, 0)
            res = self._sh(target, f"tail -c +{offset + 1} -- {q(self.run_dir)}/{q(target.log)} 2>/dev/null "
                                   f"| head -c {FOLLOW_CHUNK_BYTES} | base64")
            try:
                chunk = base64.b64decode(res.stdout.encode("ascii", "replace"))
            except (binascii.Error, ValueError):
                return NodeResult(target.name, False, "the node's log answer is not base64; its log is not shown")
            cursor.offsets[target.name] = offset + len(chunk)
            for line in _log_lines(cursor, target.name, chunk[:FOLLOW_CHUNK_BYTES]):
                emit(f"{target.name} | {line}")
            return NodeResult(target.name, True)

        return self._each_reachable(one, lambda t, e: NodeResult(t.name, False, f"unreachable: {_error(e)}"),
                                lambda t, why: NodeResult(t.name, False, why))

    def stop(self, grace_s: float = 10.0, targets: list[Target] | None = None) -> list[StopResult]:
        def one(target: Target) -> StopResult:
            data = noderecords.loads(self._probe(target, "stop", str(grace_s), timeout=grace_s + 60).strip())
            if not isinstance(data, dict) or not isinstance(data.get("left"), list):
                return StopResult(target.name, False, detail="the node's stop answer is not the probe's")
            left, signalled, killed = (_pids(data.get(key)) for key in ("left", "signalled", "killed"))
            if len(left) != len(data["left"]):
                return StopResult(target.name, False, detail="the node's stop answer names processes that are not pids")
            detail = "nothing of the run is left" if not left else f"still running: pids {list(left)}"
            return StopResult(target.name, not left, signalled, killed, left, detail)

        return self._each(one, lambda t, e: StopResult(t.name, False, detail=f"unreachable: {_error(e)}"), targets,
                          deadline_s=grace_s + CALL_TIMEOUT_S + 30)

    def fetch(self, dest: Path) -> list[NodeResult]:
        """metrics, phases, status, heartbeats, the diagnostics' JSON files (out/*.json: traces.py's profiles and
        memory trace), logs and exit codes (not checkpoints) into dest/<node dir>/. The node's archive is not
        trusted: safe_extract.py writes its regular files only, within `fetch_limits`, and replaces
        dest/<node dir>/ whole."""

        def one(target: Target) -> NodeResult:
            # the archive goes into a fresh private directory (mktemp -d, 0700), never a guessable /tmp name
            archive = '"$d/fetch.tar.gz"'
            res = self._sh(target, f"cd -- {q(self.run_dir)} && d=$(umask 077 && mktemp -d) && "
                                   f"tar -czf {archive} --ignore-failed-read out/metrics.jsonl out/phases.jsonl "
                                   f"out/status out/heartbeat out/*.json logs {q(target.node_dir)} 2>/dev/null; "
                                   f"if test -s {archive}; then echo \"$d\"; else rm -rf -- \"$d\"; exit 1; fi")
            workdir = res.stdout.strip()
            if not res.ok or not workdir.startswith("/"):
                return NodeResult(target.name, False, "nothing to fetch")
            limit = self.fetch_limits.total_bytes
            try:
                data = target.channel.get(f"{workdir}/fetch.tar.gz", limit=limit)
            except TooLarge:
                return NodeResult(target.name, False, f"node {target.name} sent a fetch.tar.gz larger than the "
                                                      f"limit of {safe_extract.mib(limit)} MiB for one node; refused")
            finally:
                self._sh(target, f"rm -rf -- {q(workdir)}")
            where = dest / target.node_dir
            try:
                done = safe_extract.extract(data, where, target.name, self.fetch_limits)
            except safe_extract.FetchRefused as exc:
                return NodeResult(target.name, False, str(exc))
            left = (f"; left out {len(done.left_out)} entr(ies) the node should not send: "
                    f"{', '.join(done.left_out[:5])}" if done.left_out else "")
            return NodeResult(target.name, True, f"{where}{left}")

        return self._each(one, lambda t, e: NodeResult(t.name, False, f"unreachable: {_error(e)}"))

    def run_command(self, command: str, targets: list[Target] | None = None) -> list[CommandResult]:
        def one(target: Target) -> CommandResult:
            res = self._sh(target, f"cd -- {q(self.run_dir)} && {command}")
            return CommandResult(target.name, res.ok, res.rc, res.stdout, res.stderr)

        return self._each_reachable(
            one, lambda t, e: CommandResult(t.name, False, None, stderr=f"unreachable: {_error(e)}"),
            lambda t, why: CommandResult(t.name, False, None, stderr=why), targets)


def _pids(value: object) -> tuple[int, ...]:
    return tuple(v for v in value if type(v) is int and 0 < v <= noderecords.PID_MAX) if isinstance(value, list) else ()


def _log_lines(cursor: LogCursor, node: str, chunk: bytes) -> list[str]:
    """The complete lines `chunk` ends (after the bytes left over from the call before), decoded with
    replacement characters; an unfinished last line waits in the cursor, one over MAX_LOG_LINE_BYTES is cut."""
    data = cursor.pending.get(node, b"") + chunk
    *lines, rest = data.split(b"\n")
    while len(rest) > MAX_LOG_LINE_BYTES:
        lines.append(rest[:MAX_LOG_LINE_BYTES])
        rest = rest[MAX_LOG_LINE_BYTES:]
    cursor.pending[node] = rest
    return [line.decode("utf-8", "replace") for line in lines]


def targets_from(manifest: Manifest, channels: dict[str, Channel]) -> list[Target]:
    """Targets for the nodes a manifest names, reached through `channels` (by node name; KeyError: a node
    the inventory lacks)."""
    missing = [name for name in manifest.node_names if name not in channels]
    if missing:
        raise KeyError(f"the inventory has no node {', '.join(missing)}")
    return [Target(n.name, channels[n.name], n.dir) for n in manifest.nodes]


__all__ = ["DEADLINE_S", "NodeExecutor", "targets_from"]
