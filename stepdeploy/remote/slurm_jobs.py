"""Pure Slurm parts of the slurm executor: the commands it sends to the controller host, reading their
answers (sbatch --parsable, squeue, sacct, scontrol), and mapping a job's state onto the per-node RunStatus
the rollout follows. Values in, values out; the executor (slurm_executor.py) does the I/O.

Job states (squeue/sacct names) and what the rollout sees:

    PENDING CONFIGURING RUNNING COMPLETING SUSPENDED REQUEUED ...   running (a node's own exit is kept)
    COMPLETED                                                        exited, code 0 unless the node says otherwise
    FAILED OUT_OF_MEMORY BOOT_FAIL DEADLINE PREEMPTED                exited, the node's code, else the job's (>= 1)
    CANCELLED                                                        exited 143 where the node recorded nothing
    TIMEOUT                                                          exited 124 where the node recorded nothing
    NODE_FAIL                                                        unreachable where the node recorded nothing
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from stepdeploy.remote.executor import EXITED, NOT_STARTED, RUNNING, UNREACHABLE, NodeStatus, RunStatus

ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                    "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "STOPPED"})
CODE_WHEN_SILENT = {"COMPLETED": 0, "CANCELLED": 143, "TIMEOUT": 124, "OUT_OF_MEMORY": 137}
SEPARATOR = "@@stepdeploy@@"
q = shlex.quote


@dataclass(frozen=True)
class JobInfo:
    """What Slurm says about one job (state UNKNOWN: no longer known to squeue, sacct or scontrol)."""

    job_id: str
    state: str
    reason: str = ""
    exit_code: int | None = None  # the job's exit code (sacct/scontrol ExitCode's first half)
    signal: int | None = None
    nodes: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def describe(self) -> str:
        text = f"slurm job {self.job_id} {self.state}"
        if self.reason and self.reason not in ("None", "(null)"):
            text += f" ({self.reason})"
        if not self.active and self.exit_code is not None:
            text += f" exit {self.exit_code}" + (f" signal {self.signal}" if self.signal else "")
        return text


# -- commands (shell text for the controller host; every value quoted) ---------------------------------------
def submit_command(script: str) -> str:
    return f"sbatch --parsable -- {q(script)}"


def query_command(job_id: str) -> str:
    """One round trip: squeue (active and recently ended jobs), sacct (needs accounting), scontrol."""
    job = q(job_id)
    return (f"squeue -h --states=all -j {job} -o '%i|%T|%r|%N' 2>/dev/null; echo {SEPARATOR}; "
            f"sacct -n -P -X -j {job} -o JobID,State,ExitCode,NodeList 2>/dev/null; echo {SEPARATOR}; "
            f"scontrol show job -o {job} 2>/dev/null; true")


def jobs_by_name_command(name: str) -> str:
    """The ids of the jobs called `name` that Slurm still knows about, newest last."""
    return f"squeue -h --states=all -n {q(name)} -o '%i|%T' 2>/dev/null | sort -t'|' -k1,1n; true"


def cancel_command(job_ids: list[str], name: str) -> str:
    ids = " ".join(q(j) for j in job_ids)
    by_id = f"scancel {ids}; " if ids else ""
    return f"{by_id}scancel --name={q(name)}"


# -- reading answers ------------------------------------------------------------------------------------------
def parse_submit(stdout: str) -> str:
    """`sbatch --parsable` prints `JOBID` or `JOBID;CLUSTER`."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    job_id = line.split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise ValueError(f"sbatch printed no job id: {stdout.strip()[-200:]!r}")
    return job_id


def _exit(text: str) -> tuple[int | None, int | None]:
    code, _, sig = text.strip().partition(":")
    return (int(code) if code.isdigit() else None), (int(sig) if sig.isdigit() else None)


def parse_query(job_id: str, stdout: str) -> JobInfo:
    parts = [*stdout.split(SEPARATOR), "", "", ""][:3]
    squeue, sacct, scontrol = (p.strip() for p in parts)
    state = reason = nodes = ""
    code = sig = None
    for line in squeue.splitlines():
        fields = line.split("|")
        if len(fields) >= 4 and fields[0].strip() == job_id:
            state, reason, nodes = fields[1].strip(), fields[2].strip(), fields[3].strip()
    for line in sacct.splitlines():
        fields = line.split("|")
        if len(fields) >= 4 and fields[0].strip() == job_id:
            state = state or fields[1].split()[0]  # "CANCELLED by 0"
            code, sig = _exit(fields[2])
            nodes = nodes or fields[3].strip()
    if scontrol:
        pairs = dict(word.split("=", 1) for word in scontrol.split() if "=" in word)
        state = state or pairs.get("JobState", "")
        reason = reason or pairs.get("Reason", "")
        nodes = nodes or pairs.get("NodeList", "")
        if code is None and "ExitCode" in pairs:
            code, sig = _exit(pairs["ExitCode"])
    return JobInfo(job_id, state.upper() or "UNKNOWN", reason, code, sig, nodes)


def parse_jobs_by_name(stdout: str) -> list[tuple[str, str]]:
    """[(job id, state)] in submission order."""
    found = []
    for line in stdout.splitlines():
        job_id, _, state = line.strip().partition("|")
        if job_id.isdigit():
            found.append((job_id, state.strip()))
    return found


# -- the job's state onto the nodes' ---------------------------------------------------------------------------
def combine(job: JobInfo | None, nodes: RunStatus) -> RunStatus:
    """The run as the rollout sees it: each node's own answer (pid, exit code, ranks) where it has one,
    the job's state where it has none. `job` None: nothing was ever submitted."""
    if job is None:
        return nodes
    return RunStatus(tuple(_node(job, n) for n in nodes.nodes))


def _node(job: JobInfo, node: NodeStatus) -> NodeStatus:
    said = job.describe()
    detail = f"{said}; {node.detail}" if node.detail else said

    def status(state: str, exit_code: int | None) -> NodeStatus:
        return NodeStatus(node.node, state, exit_code, node.ranks, detail, node.bad_records)

    if node.state == UNREACHABLE or node.state == RUNNING:
        return status(node.state, node.exit_code)
    if job.active:
        if node.state == EXITED:  # this node's part ended; the job still winds down its other nodes
            return status(EXITED, node.exit_code)
        return status(RUNNING, None)  # queued or starting
    if node.state == EXITED and node.exit_code is not None:
        return status(EXITED, node.exit_code)
    if job.state == "NODE_FAIL":
        return status(UNREACHABLE, None)
    return status(EXITED, _silent_code(job))


def _silent_code(job: JobInfo) -> int:
    """The exit code of a node whose launch recorded none (one task per GPU, or killed before it could)."""
    if job.state in CODE_WHEN_SILENT:
        return CODE_WHEN_SILENT[job.state]
    if job.state == "UNKNOWN":
        return 1
    return job.exit_code if job.exit_code else 1


def state_events(previous: str | None, job: JobInfo) -> list[str]:
    """Ledger lines for what changed since the last poll (nothing when the state is the same)."""
    if job.state == previous:
        return []
    return [job.describe() + (f" on {job.nodes}" if job.nodes and job.state == "RUNNING" else "")]


__all__ = ["ACTIVE", "NOT_STARTED", "JobInfo", "combine", "parse_query", "parse_submit", "state_events"]
