"""The executor over SSH (Fabric, host keys verified): one connection per node, calls made on all nodes in
parallel, every answer per node.

prepare  uploads the run directory as one tarball, unpacks it beside the target, checks every file's sha256
         and renames it into place: a node has the whole run directory or none of it.
start    `setsid nohup` the node's launch.sh: it leads a session and process group of its own, writes its
         pid file, and outlives the SSH session and the controller. If a node cannot be started, the nodes
         that did start are stopped (never left running alone).
stop     SIGTERM to the launch group and to every process carrying the run's STEPDEPLOY_RUN_ID, grace,
         SIGKILL, then list what is left (node_probe.py); a node is ok only when nothing is.
"""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import tarfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from fabric import Connection

from stepdeploy.inventory.model import Cluster
from stepdeploy.remote.executor import (
    EXITED,
    RUNNING,
    UNREACHABLE,
    CommandResult,
    LogCursor,
    NodeResult,
    NodeStatus,
    RankStatus,
    RunStatus,
    StopResult,
)
from stepdeploy.remote.ssh import Endpoint, connection, endpoint_for

T = TypeVar("T")
PROBE = resources.files("stepdeploy.remote").joinpath("node_probe.py").read_text()
q = shlex.quote


@dataclass(frozen=True)
class Target:
    """One node of the run: how to reach it and where its part lives."""

    name: str
    endpoint: Endpoint
    node_dir: str  # relative to the run directory

    @property
    def log(self) -> str:
        return f"logs/{self.node_dir.rsplit('/', 1)[-1]}.log"


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


class FabricExecutor:
    def __init__(self, run_id: str, run_dir: str, targets: Iterable[Target], *, connect_timeout: int = 10) -> None:
        self.run_id, self.run_dir = run_id, run_dir
        self.targets = list(targets)
        self.connect_timeout = connect_timeout
        self._conns: dict[str, Connection] = {}

    # -- plumbing -------------------------------------------------------------------------------------------
    def _conn(self, target: Target) -> Connection:
        if target.name not in self._conns:
            self._conns[target.name] = connection(target.endpoint, connect_timeout=self.connect_timeout)
        return self._conns[target.name]

    def _each(self, work: Callable[[Target], T], failed: Callable[[Target, BaseException], T],
              targets: list[Target] | None = None) -> list[T]:
        """`work` on every node in parallel; an exception becomes that node's `failed` answer."""
        chosen = self.targets if targets is None else targets

        def one(target: Target) -> T:
            try:
                return work(target)
            except Exception as exc:  # any SSH/socket/paramiko failure is this node's answer, not everyone's
                self._drop(target)
                return failed(target, exc)

        with ThreadPoolExecutor(max_workers=max(1, min(32, len(chosen)))) as pool:
            return list(pool.map(one, chosen))

    def _drop(self, target: Target) -> None:
        conn = self._conns.pop(target.name, None)
        if conn is not None:
            conn.close()

    def _sh(self, target: Target, command: str, timeout: float | None = 60) -> Any:
        return self._conn(target).run(command, hide=True, warn=True, timeout=timeout)

    def close(self) -> None:
        for target in self.targets:
            self._drop(target)

    def __enter__(self) -> FabricExecutor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- protocol -------------------------------------------------------------------------------------------
    def prepare(self, local_run: Path) -> list[NodeResult]:
        payload = _tarball(local_run)
        digest = hashlib.sha256(payload).hexdigest()[:16]
        return self._each(lambda t: self._upload(t, payload, digest),
                          lambda t, e: NodeResult(t.name, False, f"unreachable: {_error(e)}"))

    def _upload(self, target: Target, payload: bytes, digest: str) -> NodeResult:
        run_dir, parent = self.run_dir, str(Path(self.run_dir).parent)
        staging, tarball = f"{run_dir}.staging-{digest}", f"{run_dir}.upload-{digest}.tar.gz"
        # The names below are predictable: only a parent no other user can write keeps them ours (a shared
        # /tmp would let anyone plant a link the upload follows, or files torchrun imports as root).
        # -H: a parent that is a link is judged by what it points to (a link's own mode is always 0777)
        made = self._sh(target, f"mkdir -p -- {q(parent)} && "
                                f"test -z \"$(find -H {q(parent)} -maxdepth 0 -perm -0002)\"")
        if not made.ok:
            return NodeResult(target.name, False, f"{parent} is missing or writable by every user; render with a "
                                                  "--remote-dir only root can write (default /var/lib/stepdeploy/runs)")
        self._conn(target).put(io.BytesIO(payload), tarball)
        run, stage = q(run_dir), q(staging)
        script = (
            f"set -e; rm -rf -- {stage}; mkdir -p -- {stage}; tar -xzf {q(tarball)} -C {stage}; "
            f"rm -f -- {q(tarball)}; (cd -- {stage} && sha256sum --quiet -c .sha256sums); "
            f"if [ -e {run} ]; then same=0; cmp -s {run}/manifest.json {stage}/manifest.json || same=17; "
            f"rm -rf -- {stage}; exit $same; fi; "
            f"mv -T -- {stage} {run}"
        )
        res = self._sh(target, script)
        if res.exited == 17:
            return NodeResult(target.name, False, f"{run_dir} already holds another rendering; use a new run id")
        return NodeResult(target.name, res.ok, "uploaded" if res.ok else res.stderr.strip()[-500:])

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
                  f"for _ in $(seq 50); do [ -s {run}/{node_dir}/launch.pid ] && break; sleep 0.1; done; "
                  f"cat {run}/{node_dir}/launch.pid")
        res = self._sh(target, launch)
        pid = res.stdout.strip()
        if not res.ok or not pid.isdigit():
            return NodeResult(target.name, False, f"did not start: {res.stderr.strip()[-300:]}")
        return NodeResult(target.name, True, f"launch pid {pid}")

    def _probe(self, target: Target, mode: str, *extra: str, timeout: float = 60) -> dict[str, Any]:
        args = " ".join(q(a) for a in (mode, self.run_dir, self.run_id, target.node_dir, *extra))
        # -I: nothing from the working directory, PYTHONPATH or user site-packages is imported as root
        res = self._sh(target, f"python3 -I -c {q(PROBE)} {args}", timeout=timeout)
        if not res.ok:
            raise RuntimeError(f"probe failed: {res.stderr.strip()[-300:]}")
        return json.loads(res.stdout)

    def poll(self) -> RunStatus:
        def one(target: Target) -> NodeStatus:
            data = self._probe(target, "poll")
            ranks = tuple(RankStatus(rank=r.get("rank", -1), node=r.get("node") or target.name, pid=r.get("pid"),
                                     state=r.get("state", "?"), code=r.get("code"), reason=r.get("reason", ""),
                                     iteration=r.get("iteration"), heartbeat_age_s=r.get("heartbeat_age_s"))
                          for r in data["ranks"])
            return NodeStatus(target.name, data["state"], data["exit_code"], ranks,
                              f"{len(data['processes'])} process(es) of the run")

        return RunStatus(tuple(self._each(one, lambda t, e: NodeStatus(t.name, UNREACHABLE, detail=_error(e)))))

    def logs(self, tail: int = 50) -> dict[str, list[str]]:
        def one(target: Target) -> list[str]:
            res = self._sh(target, f"tail -n {int(tail)} -- {q(self.run_dir)}/{q(target.log)}")
            return [f"{target.name} | {line}" for line in res.stdout.splitlines()]

        answers = self._each(one, lambda t, e: [f"{t.name} | (unreachable: {_error(e)})"])
        return {t.name: lines for t, lines in zip(self.targets, answers, strict=True)}

    def follow(self, emit: Callable[[str], None], cursor: LogCursor) -> list[NodeResult]:
        """Emit every complete log line added since `cursor`, prefixed with the node's name; call repeatedly."""

        def one(target: Target) -> NodeResult:
            offset = cursor.offsets.get(target.name, 0)
            res = self._sh(target, f"tail -c +{offset + 1} -- {q(self.run_dir)}/{q(target.log)} 2>/dev/null")
            chunk = res.stdout
            cursor.offsets[target.name] = offset + len(chunk.encode())
            text = cursor.partial.get(target.name, "") + chunk
            *lines, cursor.partial[target.name] = text.split("\n")
            for line in lines:
                emit(f"{target.name} | {line}")
            return NodeResult(target.name, True)

        return self._each(one, lambda t, e: NodeResult(t.name, False, f"unreachable: {_error(e)}"))

    def stop(self, grace_s: float = 10.0, targets: list[Target] | None = None) -> list[StopResult]:
        def one(target: Target) -> StopResult:
            data = self._probe(target, "stop", str(grace_s), timeout=grace_s + 60)
            left = tuple(data["left"])
            detail = "nothing of the run is left" if not left else f"still running: pids {list(left)}"
            return StopResult(target.name, not left, tuple(data["signalled"]), tuple(data["killed"]), left, detail)

        return self._each(one, lambda t, e: StopResult(t.name, False, detail=f"unreachable: {_error(e)}"), targets)

    def fetch(self, dest: Path) -> list[NodeResult]:
        """metrics, status, heartbeats, logs and exit codes (not checkpoints) into dest/<node dir>/."""

        def one(target: Target) -> NodeResult:
            # the archive goes into a fresh private directory (mktemp -d, 0700), never a guessable /tmp name
            archive = '"$d/fetch.tar.gz"'
            res = self._sh(target, f"cd -- {q(self.run_dir)} && d=$(umask 077 && mktemp -d) && "
                                   f"tar -czf {archive} --ignore-failed-read out/metrics.jsonl out/phases.jsonl "
                                   f"out/status out/heartbeat logs {q(target.node_dir)} 2>/dev/null; "
                                   f"if test -s {archive}; then echo \"$d\"; else rm -rf -- \"$d\"; exit 1; fi")
            workdir = res.stdout.strip()
            if not res.ok or not workdir.startswith("/"):
                return NodeResult(target.name, False, "nothing to fetch")
            buffer = io.BytesIO()
            try:
                self._conn(target).get(f"{workdir}/fetch.tar.gz", buffer)
            finally:
                self._sh(target, f"rm -rf -- {q(workdir)}")
            where = dest / target.node_dir
            where.mkdir(parents=True, exist_ok=True)
            buffer.seek(0)
            with tarfile.open(fileobj=buffer, mode="r:gz") as archive:
                archive.extractall(where, filter="data")
            return NodeResult(target.name, True, str(where))

        return self._each(one, lambda t, e: NodeResult(t.name, False, f"unreachable: {_error(e)}"))

    def run_command(self, command: str, targets: list[Target] | None = None) -> list[CommandResult]:
        def one(target: Target) -> CommandResult:
            res = self._sh(target, f"cd -- {q(self.run_dir)} && {command}")
            return CommandResult(target.name, res.ok, res.exited, res.stdout, res.stderr)

        return self._each(one, lambda t, e: CommandResult(t.name, False, None, stderr=f"unreachable: {_error(e)}"),
                          targets)


def _tarball(local_run: Path) -> bytes:
    """The run directory as a .tar.gz, with .sha256sums of every file for the node to check."""
    sums, buffer = [], io.BytesIO()
    files = sorted(p for p in local_run.rglob("*") if p.is_file())
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in files:
            rel = path.relative_to(local_run).as_posix()
            sums.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {rel}")
            archive.add(path, rel)
        data = ("\n".join(sums) + "\n").encode()
        info = tarfile.TarInfo(".sha256sums")
        info.size, info.mode = len(data), 0o644
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def targets_from(manifest: dict[str, Any], endpoints: dict[str, Endpoint]) -> list[Target]:
    """Targets for the nodes a manifest names, reached through `endpoints` (by node name)."""
    missing = [n["name"] for n in manifest["nodes"] if n["name"] not in endpoints]
    if missing:
        raise KeyError(f"the inventory has no node {', '.join(missing)}")
    return [Target(n["name"], endpoints[n["name"]], n["dir"]) for n in manifest["nodes"]]


def executor_for_manifest(manifest: dict[str, Any], cluster: Cluster) -> FabricExecutor:
    """The executor of a rendered run, reaching its nodes as the inventory says (KeyError: a node the
    inventory lacks)."""
    endpoints = {node.name: endpoint_for(node) for node in cluster.nodes}
    return FabricExecutor(manifest["run_id"], manifest["run_dir"], targets_from(manifest, endpoints))


def executor_for_run(manifest: dict[str, Any], cluster: Cluster, local_run: Path) -> Any:
    """The executor a rendered run was made for: one Slurm job when its manifest says `executor: slurm` (job
    events go to the rollout's ledger when the run is a rollout attempt), else SSH to every node."""
    if manifest.get("executor") == "slurm":
        from stepdeploy.remote.slurm_executor import ledger_sink, slurm_executor_for_manifest

        return slurm_executor_for_manifest(manifest, cluster, local_run, ledger_sink(local_run, manifest))
    return executor_for_manifest(manifest, cluster)


__all__ = ["EXITED", "RUNNING", "FabricExecutor", "Target", "executor_for_manifest", "executor_for_run",
           "targets_from"]
