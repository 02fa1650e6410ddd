"""Failure classification from a poll plus findings, and log diagnosis from known signatures."""

from __future__ import annotations

from stepdeploy.monitor.classify import classify
from stepdeploy.monitor.diagnose import diagnose
from stepdeploy.monitor.model import Finding, Severity
from stepdeploy.remote.executor import NodeStatus, RankStatus, RunStatus

from . import faults


def _run(*ranks: RankStatus, unreachable: str | None = None) -> RunStatus:
    nodes = []
    for name in ("n1", "n2"):
        if name == unreachable:
            nodes.append(NodeStatus(name, "unreachable", detail="ssh: timed out"))
            continue
        mine = tuple(r for r in ranks if r.node == name)
        state = "running" if any(r.state == "running" for r in mine) else "exited"
        nodes.append(NodeStatus(name, state, None if state == "running" else 1, mine))
    return RunStatus(tuple(nodes))


def _rank(rank, state="running", code=None, age=1.0, iteration=100, reason=""):
    return RankStatus(rank, "n1" if rank < 2 else "n2", 1000 + rank, state, code, reason, iteration, age)


def test_healthy_and_finished_runs_are_not_failures():
    assert classify(_run(*(_rank(r) for r in range(4)))) is None
    assert classify(_run(*(_rank(r, "exited", 0) for r in range(4)))) is None


def test_killed_rank_is_a_crash_on_that_rank_not_its_victims():
    result = classify(_run(_rank(0, "exited", 3), _rank(1, "exited", 3), _rank(2, "exited", 3),
                           _rank(3, "died", iteration=99)))
    assert (result.kind, result.node, result.rank) == ("crash", "n2", 3)
    assert result.evidence[0].startswith("rank 3 on n2: died without exiting")


def test_rank_exiting_with_its_own_error_is_the_crash_and_hardware_findings_join_the_evidence():
    xid = Finding("xid", Severity.FAIL, "gpu 1", "hardware XID 79: ...", node="n1")
    result = classify(_run(_rank(0, "exited", 3), _rank(1, "exited", 1, reason="CUDA error: unknown error"),
                           _rank(2, "exited", 3), _rank(3, "exited", 3)), [xid])
    assert (result.kind, result.node, result.rank) == ("crash", "n1", 1)
    assert result.evidence == ("rank 1 on n1: exited 1 (CUDA error: unknown error)",
                               "monitor: n1 gpu 1: hardware XID 79: ...")


def test_stale_heartbeat_is_a_hang_on_the_rank_that_stopped_first():
    result = classify(_run(_rank(0, age=300, iteration=51), _rank(1, age=400, iteration=50),
                           _rank(2, age=300, iteration=51), _rank(3, age=2)), heartbeat_timeout_s=180)
    assert (result.kind, result.node, result.rank) == ("hang", "n1", 1)
    assert len(result.evidence) == 3


def test_sigstopped_rank_with_peers_timed_out_is_a_hang_not_a_link():
    result = classify(_run(_rank(0, "exited", 3), _rank(1, "exited", 3), _rank(2, age=700, iteration=40),
                           _rank(3, "exited", 3)))
    assert (result.kind, result.rank) == ("hang", 2)


def test_link_down_finding_is_a_link_failure_on_that_node():
    down = Finding("link", Severity.FAIL, "eth1", "interface up -> down", node="n2")
    result = classify(_run(_rank(0, "exited", 3), _rank(1, "exited", 3), _rank(2, "exited", 3),
                           _rank(3, "exited", 3)), [down])
    assert (result.kind, result.node) == ("link", "n2")
    assert result.evidence[0] == "monitor: n2 eth1: interface up -> down"


def test_collective_failures_alone_are_a_link_failure():
    result = classify(_run(*(_rank(r, "exited", 3) for r in range(4))))
    assert result.kind == "link" and result.node is None and len(result.evidence) == 5


def test_unreachable_node_is_node_loss_first():
    result = classify(_run(_rank(0, "exited", 3), _rank(1, "exited", 3), unreachable="n2"))
    assert (result.kind, result.node) == ("node-loss", "n2")
    assert result.evidence == ("node n2 unreachable: ssh: timed out",)


LOG = """\
[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity
[rank0]:[E1129 12:00:01 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(
iteration 120 | loss nan | grad norm inf
host-2:1234:1290 [0] NCCL INFO NET/IB : Got completion from peer 10.0.0.2 with status=12 opcode=0 len=0 vendor err 129
NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver
[ 4711.123456] NVRM: Xid (PCI:0000:00:07): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4312
"""


def test_each_signature_is_recognised_with_cause_and_fix_causes_first():
    found = {d.signature: d for d in diagnose(LOG)}
    assert list(found) == ["xid", "nvidia_smi_failed", "cuda_oom", "nan_loss", "ib_error", "gloo_connection",
                           "nccl_timeout"]
    assert found["xid"].cause.startswith("hardware XID 79") and "drain the node" in found["xid"].fix
    assert "modprobe nvidia" in found["nvidia_smi_failed"].fix
    assert "micro-batch" in found["cuda_oom"].fix
    assert found["nccl_timeout"].evidence.startswith("[rank0]:[E1129")


def test_application_xid_and_clean_log():
    assert diagnose("step 10 loss 2.31 info: saved checkpoint\nall good") == []
    (found,) = diagnose(faults.XID_13_GPU0)
    assert found.cause.startswith("application-level XID 13")


def test_a_taken_rendezvous_port_names_the_run_left_on_the_node():
    # torchrun's last line when another run holds the port (seen on the H200: a rollout whose controller was killed
    # left its soak training; the next rollout's warm-up died in 3 s, its gate said only "exited")
    log = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
           "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    (found,) = diagnose(log)
    assert found.signature == "port_in_use" and "another run" in found.cause and "rollout stop" in found.fix


def test_a_dead_checkpoint_writer_is_named_before_its_peers_lost_collectives():
    # the megatron engine's log line when its persistent checkpoint writer dies (megatron_writer.writer_died); the
    # other ranks' collectives then lose this rank
    log = ("[rank 3] checkpoint writer process 81234 died (killed by signal SIGKILL) during the save of iteration "
           "400: the rank cannot save, it exits\n"
           "[rank 0] RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    found = diagnose(log)
    assert [d.signature for d in found] == ["checkpoint_writer_died", "gloo_connection"]
    assert "OOM killer" in found[0].cause and "not committed" in found[0].cause
    assert "dmesg" in found[0].fix and "rollout resume" in found[0].fix
    assert found[0].evidence.startswith("[rank 3] checkpoint writer process 81234 died")
