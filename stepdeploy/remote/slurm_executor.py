"""The executor through Slurm: the rendered run's `sbatch.sh` submitted on the Slurm controller host over SSH
(Fabric, host keys verified), followed with squeue/sacct/scontrol, cancelled with scancel.

The nodes are still reached over SSH for what Slurm does not do: upload the run directory (each node gets
its own copy, as with the SSH executor: no shared filesystem is assumed), read every rank's status and
heartbeat, stream the logs, fetch the results, and -- after scancel -- prove that no process carrying the
run's STEPDEPLOY_RUN_ID is left on any node (node_probe.py's stop: what Slurm's process tracking missed is
killed there and then listed; a node is ok only when nothing is).

The job ids of a run are kept in `<local run>/slurm-jobs` (one per line, newest last) so a new controller
(`rollout stop`, `rollout resume`) finds the job; `scancel --name` catches a job whose id was never recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Cluster
from stepdeploy.remote import slurm_jobs as sj
from stepdeploy.remote.executor import (
    CommandResult,
    EventSink,
    LogCursor,
    NodeResult,
    NodeStatus,
    RunStatus,
    StopResult,
    Target,
    no_events,
)
from stepdeploy.remote.node_executor import NodeExecutor, targets_from
from stepdeploy.remote.ssh import Endpoint, endpoint_for
from stepdeploy.remote.transport import CALL_TIMEOUT_S, CONNECT_TIMEOUT_S, Ran, SshChannel, channel_for
from stepdeploy.render.manifest import Manifest

JOBS_FILE = "slurm-jobs"


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


class SlurmExecutor:
    kind = "slurm"
    # A poll is NodeExecutor's (every node at once) and then, in turn, squeue + sacct + scontrol on the controller:
    # two SSH round trips, and queries that slurmctld and slurmdbd answer for every job that polls. Not measured on
    # the simulated Slurm cluster yet, so it stays at 2 s (the SSH executor's 0.5 s rests on bench/fault_matrix.py).
    poll_interval_s = 2.0

    def __init__(self, run_id: str, run_dir: str, targets: Iterable[Target], controller: Endpoint, *,
                 job_name: str, script: str = "sbatch.sh", jobs_file: Path | None = None,
                 on_event: EventSink = no_events, connect_timeout: int = CONNECT_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.nodes = NodeExecutor(run_id, run_dir, targets)
        self.run_id, self.run_dir, self.job_name, self.script = run_id, run_dir, job_name, script
        self.controller, self.jobs_file = controller, jobs_file
        self.on_event = on_event
        self.clock, self.sleep = clock, sleep
        self._channel = SshChannel("slurm controller", controller, connect_timeout)
        self._last_state: str | None = None

    @property
    def targets(self) -> list[Target]:
        return self.nodes.targets

    # -- plumbing -------------------------------------------------------------------------------------------
    def _ctl(self, command: str, timeout: float = CALL_TIMEOUT_S) -> Ran:
        ran = self._channel.run(command, timeout)
        if ran.timed_out:
            raise TimeoutError(f"no answer within {timeout:g} s")
        return ran

    def close(self) -> None:
        self._channel.close()
        self.nodes.close()

    def __enter__(self) -> SlurmExecutor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def job_ids(self) -> list[str]:
        """Every job submitted for this run directory, oldest first."""
        if self.jobs_file is None or not self.jobs_file.exists():
            return []
        return [line.strip() for line in self.jobs_file.read_text().splitlines() if line.strip().isdigit()]

    def _record(self, job_id: str) -> None:
        if self.jobs_file is not None:
            with self.jobs_file.open("a") as handle:
                handle.write(job_id + "\n")

    def current_job(self) -> str | None:
        """The run's latest job: the newest of those recorded and those Slurm knows by the run's job name (a
        controller killed between sbatch and recording its answer left one unrecorded: it is recorded now)."""
        ids = self.job_ids()
        named = [j for j, _state in sj.parse_jobs_by_name(self._ctl(sj.jobs_by_name_command(self.job_name)).stdout)]
        newest = max([*ids, *named], key=int, default=None)
        if newest is not None and newest not in ids:
            self._record(newest)
        return newest

    def job(self) -> sj.JobInfo | None:
        job_id = self.current_job()
        if job_id is None:
            return None
        return sj.parse_query(job_id, self._ctl(sj.query_command(job_id)).stdout)

    # -- protocol -------------------------------------------------------------------------------------------
    def describe(self, local_run: Path) -> list[str]:
        uploads = [f"{t.name} ({t.channel.where}): upload {local_run} to {self.run_dir}" for t in self.targets]
        return [*uploads, f"slurm controller ({self.controller.host}): sbatch --parsable {self.run_dir}/{self.script} "
                          f"(job {self.job_name}); squeue/sacct to follow, scancel to stop"]

    def prepare(self, local_run: Path) -> list[NodeResult]:
        return self.nodes.prepare(local_run)

    def start(self) -> list[NodeResult]:
        """Submit the batch script (a soak restart submits it again: a new job, same run directory)."""
        names = [t.name for t in self.targets]
        try:
            live = [j for j, state in sj.parse_jobs_by_name(self._ctl(sj.jobs_by_name_command(self.job_name)).stdout)
                    if state in sj.ACTIVE]
            if live:
                return [NodeResult(n, False, f"slurm job {live[-1]} ({self.job_name}) is still queued or running; "
                                             "stop it first") for n in names]
            # sbatch opens logs/slurm-<job>.out before the script runs: the directory must exist
            cleared = self.nodes.run_command("mkdir -p logs out && rm -f -- nodes/*/launch.pid nodes/*/exit_code")
            bad = [c for c in cleared if not c.ok]
            if bad:
                return [NodeResult(c.node, c.ok, "" if c.ok else f"cannot reset its node files: {c.stderr.strip()}")
                        for c in cleared]
            res = self._ctl(sj.submit_command(f"{self.run_dir}/{self.script}"))
            if not res.ok:
                return [NodeResult(n, False, f"sbatch failed: {(res.stderr or res.stdout).strip()[-300:]}")
                        for n in names]
            job_id = sj.parse_submit(res.stdout)
        except Exception as exc:  # the controller host cannot be reached, or sbatch printed nonsense
            return [NodeResult(n, False, f"slurm controller {self.controller.host}: {_error(exc)}") for n in names]
        self._record(job_id)
        self._last_state = None
        previous = len(self.job_ids()) - 1
        what = f"slurm job {job_id} submitted ({self.job_name})" + (f", resubmission {previous}" if previous else "")
        self.on_event(what, {"job_id": job_id, "job_name": self.job_name, "submission": previous + 1})
        return [NodeResult(n, True, f"slurm job {job_id}") for n in names]

    def poll(self) -> RunStatus:
        nodes = self.nodes.poll()
        try:
            job = self.job()
        except Exception as exc:  # the controller is down: the nodes' own answers are all we have
            return RunStatus(tuple(NodeStatus(n.node, n.state, n.exit_code, n.ranks,
                                              f"slurm controller unreachable: {_error(exc)}", n.bad_records)
                                   for n in nodes.nodes))
        self._note(job)
        return sj.combine(job, nodes)

    def logs(self, tail: int = 50) -> dict[str, list[str]]:
        return self.nodes.logs(tail)

    def follow(self, emit: Callable[[str], None], cursor: LogCursor) -> list[NodeResult]:
        return self.nodes.follow(emit, cursor)

    def stop(self, grace_s: float = 10.0, targets: list[Target] | None = None) -> list[StopResult]:
        """scancel every job of the run, wait for Slurm to end them, then kill and list whatever is left."""
        note = self._cancel(grace_s)
        results = self.nodes.stop(grace_s, targets)
        return [StopResult(r.node, r.ok, r.signalled, r.killed, r.left, f"{note}; {r.detail}") for r in results]

    def _cancel(self, grace_s: float) -> str:
        try:
            ids = self.job_ids()[-1:]  # earlier jobs of a resubmitted soak have ended; --name catches any other
            res = self._ctl(sj.cancel_command(ids, self.job_name))
            deadline = self.clock() + grace_s + 30  # Slurm's KillWait (30 s) after its SIGTERM
            while True:
                active = [j for j, state in sj.parse_jobs_by_name(
                    self._ctl(sj.jobs_by_name_command(self.job_name)).stdout) if state in sj.ACTIVE]
                if not active or self.clock() >= deadline:
                    break
                self.sleep(1.0)
        except Exception as exc:
            return f"scancel not confirmed (slurm controller {self.controller.host}: {_error(exc)})"
        self._final_state()
        what = ", ".join(ids) or "by name"
        if active:
            note = f"scancel {what}: jobs {', '.join(active)} still active after {grace_s + 30:.0f} s"
        else:
            note = f"scancel {what}: no job of the run is left in Slurm"
            note += "" if res.ok else f" ({res.stderr.strip()[-200:]})"
        self.on_event(note, {"job_ids": ids, "still_active": active})
        return note

    def _final_state(self) -> None:
        """Record how the latest job ended (it may end between two polls, or after the last one)."""
        try:
            job = self.job()
        except Exception:  # the state is a record, not a proof: the nodes' probe that follows is the proof
            return
        self._note(job)

    def _note(self, job: sj.JobInfo | None) -> None:
        """An event for each change of the job's state."""
        if job is None:
            return
        for line in sj.state_events(self._last_state, job):
            self.on_event(line, {"job_id": job.job_id, "state": job.state, "reason": job.reason,
                                 "exit_code": job.exit_code})
        self._last_state = job.state

    def fetch(self, dest: Path) -> list[NodeResult]:
        return self.nodes.fetch(dest)

    def run_command(self, command: str, targets: list[Target] | None = None) -> list[CommandResult]:
        return self.nodes.run_command(command, targets)


def controller_endpoint(cluster: Cluster) -> Endpoint:
    """Where sbatch runs: the inventory's stepdeploy_slurm_controller -- a node's name (reached as that node)
    or another host (reached with the first node's SSH user, port, key and known_hosts) -- else the first node."""
    name = cluster.slurm.controller or cluster.nodes[0].name
    for node in cluster.nodes:
        if name in (node.name, node.address):
            return endpoint_for(node)
    first = endpoint_for(cluster.nodes[0])
    return Endpoint(host=name, user=first.user, port=first.port, key_file=first.key_file,
                    known_hosts=first.known_hosts, proxy_jump=first.proxy_jump)


def create(manifest: Manifest, cluster: Cluster, local_run: Path, on_event: EventSink) -> SlurmExecutor:
    """The slurm executor of a run rendered for it (manifest `executor: slurm`); job events go to `on_event`."""
    channels = {node.name: channel_for(node) for node in cluster.nodes}
    slurm = manifest.slurm
    if slurm is None:
        raise BadInput(f"run {manifest.run_id} was not rendered for Slurm (no slurm section in its manifest)",
                       hint="render it again with --executor slurm")
    return SlurmExecutor(manifest.run_id, manifest.run_dir, targets_from(manifest, channels),
                         controller_endpoint(cluster), job_name=slurm.job_name, script=slurm.script,
                         jobs_file=local_run / JOBS_FILE, on_event=on_event)


__all__ = ["JOBS_FILE", "SlurmExecutor", "controller_endpoint", "create"]
