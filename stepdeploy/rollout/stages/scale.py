"""The scaling ladder (rollout/ladder.py): a proxy on one GPU, one node, all nodes, then the target on all nodes,
each rung one gated attempt. A rung is judged against the previous rung of the same model (scaling efficiency);
a rung that changes the model (the target after its proxy) by its MFU against the plan."""

from __future__ import annotations

from typing import Any

from stepdeploy.inventory.model import Cluster
from stepdeploy.rollout import gates
from stepdeploy.rollout.config import RolloutConfig, StageStopped
from stepdeploy.rollout.ladder import Rung, scale_ladder
from stepdeploy.rollout.service import AttemptService, GateFailed
from stepdeploy.rollout.stages.gated import GATES, Metrics, gated_attempt

Previous = tuple[str, float | None]  # the last rung run: (its model, its per-GPU throughput)


def rung_gates(config: RolloutConfig, rung: Rung, previous_model: str | None) -> list[str]:
    """The gates the rung is judged by, in order (what the dry run lists; `rung_verdicts` gives these)."""
    scaling = "mfu_vs_plan" if previous_model not in (None, rung.model) else "scaling_efficiency"
    ceiling = ["step_time"] if config.thresholds.max_step_time_s is not None else []
    return [*GATES, "loss_falling", scaling, "memory_vs_plan", *ceiling]


def rung_verdicts(config: RolloutConfig, rung: Rung, metrics: Metrics, summary: dict[str, Any],
                  previous: Previous | None) -> list[gates.GateVerdict]:
    """The rung's own gates (after the gated attempt's): scaling efficiency only against the previous rung of the
    same model; a rung that changes the model is judged by its MFU against the plan."""
    t = config.thresholds
    current = gates.throughput_per_gpu(metrics, rung.world)
    peak = max((m["mem_peak_gib"] for m in metrics if m.get("mem_peak_gib")), default=None)
    if previous is not None and previous[0] != rung.model:
        scaling = gates.mfu_matches_plan(gates.steady_mfu(metrics), summary.get("predicted_mfu"), t)
    else:
        scaling = gates.scaling_efficiency(current, previous[1] if previous else None, t)
    verdicts = [gates.loss_falling(metrics, t), scaling,
                gates.memory_matches_plan(peak, summary.get("predicted_torch_allocated_gib"), t)]
    ceiling = gates.step_time_ceiling(metrics, t)
    return [*verdicts, ceiling] if ceiling else verdicts


class Scale:
    name = "scale"

    def run(self, service: AttemptService) -> None:
        config, ledger, run_id = service.config, service.ledger, service.run_id
        rungs = scale_ladder(service.cluster, config.model, config.proxy_model)
        ledger.add_rungs(run_id, self.name, [(r.name, r.as_dict()) for r in rungs])
        done = {r["name"]: r for r in ledger.rungs(run_id, self.name)}
        previous: Previous | None = None
        for rung in rungs:
            if done[rung.name]["status"] == "passed":
                previous = (rung.model, _recorded_throughput(service, rung.name))
                continue
            if rung.skip_reason:
                ledger.set_rung(run_id, self.name, rung.name, "skipped", rung.skip_reason)
                continue
            ledger.set_rung(run_id, self.name, rung.name, "running")
            declared = rung_gates(config, rung, previous[0] if previous else None)
            try:
                metrics = gated_attempt(service, self.name, rung, config.scale_iterations, declared,
                                        lambda m, s, r=rung, p=previous: rung_verdicts(config, r, m, s, p))
            except StageStopped:
                ledger.set_rung(run_id, self.name, rung.name, "stopped", "stop requested")
                raise
            except GateFailed as exc:
                ledger.set_rung(run_id, self.name, rung.name, "failed", exc.verdict.reason)
                raise
            previous = (rung.model, gates.throughput_per_gpu(metrics, rung.world))
            ledger.set_rung(run_id, self.name, rung.name, "passed")

    def plan(self, config: RolloutConfig, cluster: Cluster) -> list[dict[str, Any]]:
        rungs, previous = [], None
        for r in scale_ladder(cluster, config.model, config.proxy_model):
            rungs.append({"rung": r.name, **r.as_dict(), "iterations": config.scale_iterations,
                          "gates": rung_gates(config, r, previous)})
            previous = previous if r.skip_reason else r.model
        return rungs


def _recorded_throughput(service: AttemptService, rung: str) -> float | None:
    attempts = service.ledger.attempts(service.run_id, "scale")
    passed = [a for a in attempts if a["rung"] == rung and a["status"] == "passed"]
    return passed[-1]["detail"].get("tokens_per_gpu") if passed else None


STAGE = Scale()
