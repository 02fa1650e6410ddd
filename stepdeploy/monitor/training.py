"""Judgements of the training between two samples: hangs (heartbeat age), loss NaN/Inf and spikes, grad-norm
range, per-rank step-time skew (stragglers). Only metrics rows written after the previous sample are judged;
the rows before them are the history a spike is measured against.
"""

from __future__ import annotations

from statistics import mean, median

from stepdeploy.monitor.model import Finding, MetricsRow, MonitorLimits, NodeSample, Severity
from stepdeploy.monitor.parse_workload import is_finite

HANG_FIX = ("py-spy dump --pid <pid> on the stuck rank (or its peers, if it waits in a collective); the run "
            "is stopped and restarted from the last checkpoint")
NAN_FIX = ("restart from the last checkpoint, with a lower learning rate or longer warmup; check the data "
           "batch at that iteration and bf16 overflow (loss scale)")


def judge_training(prev: NodeSample, cur: NodeSample, limits: MonitorLimits | None = None) -> list[Finding]:
    limits = limits or MonitorLimits()
    found = [*_hangs(prev, cur, limits), *_losses(prev, cur, limits), *_grad_norms(prev, cur, limits),
             *_stragglers(prev, cur, limits)]
    return [Finding(f.kind, f.severity, f.subject, f.message, cur.node, f.fix) for f in found]


def heartbeat_ages(sample: NodeSample) -> dict[int, float]:
    """rank -> seconds since its last heartbeat, for the ranks whose status file still says running."""
    stopped = {r.rank for r in sample.ranks if r.state != "running"}
    return {b.rank: sample.time - b.time for b in sample.heartbeats if b.rank not in stopped}


def _hangs(prev: NodeSample, cur: NodeSample, limits: MonitorLimits) -> list[Finding]:
    before, timeout = heartbeat_ages(prev), limits.heartbeat_timeout_s
    found = []
    for rank, age in sorted(heartbeat_ages(cur).items()):
        if age > timeout and before.get(rank, 0.0) <= timeout:
            beat = next(b for b in cur.heartbeats if b.rank == rank)
            found.append(Finding("hang", Severity.FAIL, f"rank {rank}",
                                 f"no heartbeat for {age:.0f} s (timeout {timeout:.0f} s), stuck after "
                                 f"iteration {beat.iteration} (pid {beat.pid})", fix=HANG_FIX))
    return found


def new_rows(prev: NodeSample, cur: NodeSample) -> list[tuple[int, MetricsRow]]:
    """(position in cur.metrics, row) of the rows written after the previous sample's last row."""
    times = [r.time for r in prev.metrics if r.time is not None]
    if times:
        last = max(times)
        return [(i, r) for i, r in enumerate(cur.metrics) if r.time is not None and r.time > last]
    last_iteration = max((r.iteration for r in prev.metrics), default=None)
    return [(i, r) for i, r in enumerate(cur.metrics) if last_iteration is None or r.iteration > last_iteration]


def _iterations(rows: list[MetricsRow]) -> str:
    shown = ", ".join(str(r.iteration) for r in rows[:5])
    return shown + (f" (+{len(rows) - 5} more)" if len(rows) > 5 else "")


def _losses(prev: NodeSample, cur: NodeSample, limits: MonitorLimits) -> list[Finding]:
    bad, spikes = [], []
    for position, row in new_rows(prev, cur):
        if row.loss is None:
            continue
        if not is_finite(row.loss):
            bad.append(row)
            continue
        history = [r.loss for r in cur.metrics[:position] if is_finite(r.loss)][-limits.loss_window:]
        if len(history) >= limits.loss_min_history and row.loss > limits.loss_spike_factor * median(history):
            spikes.append((row, median(history)))
    found = []
    if bad:
        found.append(Finding("loss", Severity.FAIL, "training",
                             f"loss {bad[0].loss} at iteration {_iterations(bad)}", fix=NAN_FIX))
    if spikes:
        row, base = spikes[0]
        found.append(Finding("loss", Severity.WARN, "training",
                             f"loss spike {row.loss:.4g} > {limits.loss_spike_factor:g} x running median "
                             f"{base:.4g} at iteration {_iterations([r for r, _ in spikes])}",
                             fix="watch the next iterations; roll back to the last checkpoint if it does not recover"))
    return found


def _grad_norms(prev: NodeSample, cur: NodeSample, limits: MonitorLimits) -> list[Finding]:
    rows = [r for _, r in new_rows(prev, cur) if r.grad_norm is not None]
    bad = [r for r in rows if not is_finite(r.grad_norm)]
    high = [r for r in rows if is_finite(r.grad_norm) and r.grad_norm > limits.grad_norm_max]  # type: ignore[operator]
    found = []
    if bad:
        found.append(Finding("grad_norm", Severity.FAIL, "training",
                             f"grad norm {bad[0].grad_norm} at iteration {_iterations(bad)}", fix=NAN_FIX))
    if high:
        peak = max(high, key=lambda r: r.grad_norm)  # type: ignore[arg-type, return-value]
        found.append(Finding("grad_norm", Severity.WARN, "training",
                             f"grad norm {peak.grad_norm:.4g} > {limits.grad_norm_max:g} at iteration "
                             f"{_iterations(high)}", fix="a loss spike often follows; check the data and the LR"))
    return found


def _stragglers(prev: NodeSample, cur: NodeSample, limits: MonitorLimits) -> list[Finding]:
    rows = [r for _, r in new_rows(prev, cur) if r.rank_step_time_s]
    world = len(rows[0].rank_step_time_s) if rows else 0
    rows = [r for r in rows if len(r.rank_step_time_s) == world]
    if world < 2 or len(rows) < limits.straggler_min_steps:
        return []
    means = [mean(r.rank_step_time_s[rank] for r in rows) for rank in range(world)]
    middle = median(means)
    limit = (1 + limits.straggler_fraction) * middle
    return [Finding("straggler", Severity.WARN, f"rank {rank}",
                    f"mean step time {t:.3f} s > {1 + limits.straggler_fraction:g} x the ranks' median "
                    f"{middle:.3f} s over {len(rows)} steps",
                    fix="check that rank's GPU (clocks, temperature, XIDs) and its node's load; the whole job "
                        "runs at the slowest rank's pace")
            for rank, t in enumerate(means) if middle > 0 and t > limit]
