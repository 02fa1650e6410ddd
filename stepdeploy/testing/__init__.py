"""Test support: a fake clock and a scripted executor, so a rollout's state machine (the soak's detect, stop,
restart and resume) runs in a unit test in milliseconds, without nodes, SSH or torch.

    clock = FakeClock()
    nodes = FakeNodes(clock, ("node1", "node2"), step_s=1.0, save_every=5)
    nodes.at(start=1, after_s=20, kill=1)                 # rank 1 killed 20 s into the first start
    nodes.fail("start", "node2", "unreachable: SSHException: host key refused")   # the next start, once
    Rollout(run_dir, Ledger(path, clock=clock.time), run_id, config, cluster=cluster,
            clock=clock.clock, executors=nodes.executor).run()

FakeNodes is the run's world, shared by every executor the controller opens on it (one per attempt, as with
real nodes): it keeps what the workload would write on the nodes -- rank 0's out/metrics.jsonl and
out/phases.jsonl, every rank's status and heartbeat, each node's log (appended across starts) -- and advances
it on the clock: after a start's `startup_s` one iteration every `step_s`, a checkpoint every `save_every`
iterations, a restart resuming from the last one. A start of another rendered run (warmup's, each scale rung's)
starts from scratch on that run's nodes; a run ends with exit 0 after its workload.json's iterations (the soak's
never do), and an MoE model's metrics carry an expert load. `fetch` writes those files where the real collect path reads
them. Faults are scripted per start (kill, hang, a rank exiting with a log line, a node unreachable for a
while) and per call (`fail`: the next prepare/start/stop/fetch/run_command answers not-ok on a node);
`run_command` understands the controller's own commands (the latest metrics line, the rank files cleared, the
attempt marker, an injected kill) and answers `respond`'s scripted output for the others."""

from __future__ import annotations

from stepdeploy.testing.executor import FakeExecutor, FakeTarget
from stepdeploy.testing.nodes import FakeClock, FakeNodes, Fault

__all__ = ["FakeClock", "FakeExecutor", "FakeNodes", "FakeTarget", "Fault"]
