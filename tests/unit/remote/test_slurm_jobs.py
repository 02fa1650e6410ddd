"""The slurm executor's pure parts: what it sends to the controller, how it reads squeue/sacct/scontrol, and
how a job's state becomes the per-node status the rollout follows (recorded outputs of Slurm 22.05)."""

from __future__ import annotations

import shlex

import pytest

from stepdeploy.remote import slurm_jobs as sj
from stepdeploy.remote.executor import NodeStatus, RankStatus, RunStatus

SCONTROL_FAILED = ("JobId=2 JobName=t1 UserId=root(0) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
                   "Requeue=1 Restarts=0 BatchFlag=1 ExitCode=143:0 RunTime=00:00:03 NodeList=node[1-2] "
                   "BatchHost=node1 NumNodes=2 Command=/tmp/t.sh WorkDir=/tmp")


def answer(squeue: str = "", sacct: str = "", scontrol: str = "") -> str:
    return f"{squeue}\n{sj.SEPARATOR}\n{sacct}\n{sj.SEPARATOR}\n{scontrol}\n"


def test_sbatch_parsable_gives_the_job_id_with_or_without_a_cluster_name() -> None:
    assert sj.parse_submit("42\n") == "42"
    assert sj.parse_submit("Submitted to cluster\n43;gpu-cluster\n") == "43"
    with pytest.raises(ValueError, match="no job id"):
        sj.parse_submit("sbatch: error: Batch job submission failed: Invalid node name specified\n")


def test_a_running_job_is_read_from_squeue() -> None:
    job = sj.parse_query("7", answer("7|RUNNING|None|node[1-2]"))
    assert (job.state, job.active, job.nodes, job.exit_code) == ("RUNNING", True, "node[1-2]", None)
    assert job.describe() == "slurm job 7 RUNNING"


def test_a_pending_job_says_why() -> None:
    job = sj.parse_query("8", answer("8|PENDING|Resources|"))
    assert job.active and job.describe() == "slurm job 8 PENDING (Resources)"


def test_without_accounting_the_exit_code_comes_from_scontrol() -> None:
    job = sj.parse_query("2", answer("2|FAILED|NonZeroExitCode|node[1-2]", "", SCONTROL_FAILED))
    assert (job.state, job.exit_code, job.signal, job.active) == ("FAILED", 143, 0, False)
    assert job.describe() == "slurm job 2 FAILED (NonZeroExitCode) exit 143"


def test_sacct_wins_for_the_exit_code_and_its_cancelled_by_suffix_is_dropped() -> None:
    job = sj.parse_query("9", answer("", "9|CANCELLED by 0|0:15|node[1-2]", ""))
    assert (job.state, job.exit_code, job.signal, job.nodes) == ("CANCELLED", 0, 15, "node[1-2]")


def test_a_job_slurm_no_longer_knows_is_unknown_and_not_active() -> None:
    job = sj.parse_query("10", answer())
    assert job.state == "UNKNOWN" and not job.active


def test_other_jobs_lines_are_ignored() -> None:
    job = sj.parse_query("11", answer("110|RUNNING|None|node1\n11|COMPLETING|None|node2"))
    assert job.state == "COMPLETING" and job.nodes == "node2"


def test_every_value_in_a_controller_command_is_quoted() -> None:
    hostile = "x; touch /tmp/pwned"
    for command in (sj.submit_command(hostile), sj.query_command(hostile), sj.jobs_by_name_command(hostile),
                    sj.cancel_command([hostile], hostile)):
        assert shlex.quote(hostile) in command
        assert hostile not in command.replace(shlex.quote(hostile), ""), command  # never bare
    assert sj.cancel_command([], "sd-soak-r1") == "scancel --name=sd-soak-r1"
    assert sj.cancel_command(["5"], "sd-soak-r1") == "scancel 5; scancel --name=sd-soak-r1"


def test_jobs_by_name_in_submission_order() -> None:
    assert sj.parse_jobs_by_name("5|CANCELLED\n6|RUNNING\njunk\n") == [("5", "CANCELLED"), ("6", "RUNNING")]


def nodes(*states: NodeStatus) -> RunStatus:
    return RunStatus(states)


RANK0 = RankStatus(0, "node1", 100, "running", iteration=4)


@pytest.mark.parametrize("state", ["PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED"])
def test_an_active_job_keeps_the_rollout_following_even_before_its_launch_scripts_start(state: str) -> None:
    job = sj.JobInfo("3", state, "Priority" if state == "PENDING" else "None")
    status = sj.combine(job, nodes(NodeStatus("node1", "not-started"), NodeStatus("node2", "not-started")))
    assert status.running and all(n.state == "running" for n in status.nodes)
    assert all(n.detail.startswith(f"slurm job 3 {state}") for n in status.nodes)


def test_a_running_job_shows_each_nodes_own_state_and_ranks() -> None:
    job = sj.JobInfo("3", "RUNNING")
    status = sj.combine(job, nodes(NodeStatus("node1", "running", ranks=(RANK0,), detail="4 process(es) of the run"),
                                   NodeStatus("node2", "exited", 1)))
    assert [(n.state, n.exit_code) for n in status.nodes] == [("running", None), ("exited", 1)]
    assert status.nodes[0].ranks == (RANK0,)
    assert status.nodes[0].detail == "slurm job 3 RUNNING; 4 process(es) of the run"


def test_a_completed_job_is_finished_ok() -> None:
    job = sj.JobInfo("3", "COMPLETED", exit_code=0)
    status = sj.combine(job, nodes(NodeStatus("node1", "exited", 0), NodeStatus("node2", "exited", 0)))
    assert status.finished_ok and not status.running


def test_a_failed_job_keeps_the_codes_the_nodes_recorded_and_names_the_dead_rank() -> None:
    died = RankStatus(1, "node2", 563, "died")
    victim = RankStatus(0, "node1", 500, "exited", 143, "terminated")
    job = sj.JobInfo("5", "FAILED", "NonZeroExitCode", exit_code=1)
    status = sj.combine(job, nodes(NodeStatus("node1", "exited", 143, (victim,)),
                                   NodeStatus("node2", "exited", 1, (died,))))
    assert not status.running and not status.finished_ok
    assert status.culprits() == ["node node2 rank 1: died without exiting (pid 563 gone; killed or crashed)"]


@pytest.mark.parametrize(("state", "code"), [("CANCELLED", 143), ("TIMEOUT", 124), ("OUT_OF_MEMORY", 137),
                                             ("FAILED", 7), ("BOOT_FAIL", 1), ("UNKNOWN", 1), ("COMPLETED", 0)])
def test_a_node_that_recorded_nothing_takes_the_jobs_ending(state: str, code: int) -> None:
    job = sj.JobInfo("5", state, exit_code=7 if state == "FAILED" else 0)
    status = sj.combine(job, nodes(NodeStatus("node1", "not-started")))
    assert (status.nodes[0].state, status.nodes[0].exit_code) == ("exited", code)


def test_node_fail_makes_a_silent_node_unreachable() -> None:
    job = sj.JobInfo("5", "NODE_FAIL")
    status = sj.combine(job, nodes(NodeStatus("node1", "exited", 3), NodeStatus("node2", "not-started")))
    assert [n.state for n in status.nodes] == ["exited", "unreachable"]
    assert status.culprits()[0].startswith("node node2: unreachable (slurm job 5 NODE_FAIL")


def test_processes_that_outlive_their_job_keep_the_run_running_so_they_get_stopped() -> None:
    status = sj.combine(sj.JobInfo("5", "CANCELLED"), nodes(NodeStatus("node1", "running")))
    assert status.running


def test_no_job_yet_is_the_nodes_own_answer() -> None:
    plain = nodes(NodeStatus("node1", "not-started"))
    assert sj.combine(None, plain) is plain


def test_state_changes_become_one_event_each() -> None:
    running = sj.JobInfo("5", "RUNNING", nodes="node[1-2]")
    assert sj.state_events(None, running) == ["slurm job 5 RUNNING on node[1-2]"]
    assert sj.state_events("RUNNING", running) == []
    failed = sj.JobInfo("5", "FAILED", "NonZeroExitCode", exit_code=1)
    assert sj.state_events("RUNNING", failed) == ["slurm job 5 FAILED (NonZeroExitCode) exit 1"]
