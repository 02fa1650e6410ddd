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
        config = service.config
        rungs = scale_ladder(service.cluster, config.model, config.proxy_model)
        service.add_rungs(self.name, rungs)
        done = service.rung_states(self.name)
        previous: Previous | None = None
        for rung in rungs:
            if done[rung.name] == "passed":
                previous = (rung.model, _recorded_throughput(service, rung.name))
                continue
            if rung.skip_reason:
                service.set_rung(self.name, rung.name, "skipped", rung.skip_reason)
                continue
            service.set_rung(self.name, rung.name, "running")
            declared = rung_gates(config, rung, previous[0] if previous else None)
            try:
                metrics = gated_attempt(service, self.name, rung, config.scale_iterations, declared,
                                        lambda m, s, r=rung, p=previous: rung_verdicts(config, r, m, s, p))
            except StageStopped:
                service.set_rung(self.name, rung.name, "stopped", "stop requested")
                raise
            except GateFailed as exc:
                service.set_rung(self.name, rung.name, "failed", exc.verdict.reason)
                raise
            previous = (rung.model, gates.throughput_per_gpu(metrics, rung.world))
            service.set_rung(self.name, rung.name, "passed")

    def plan(self, config: RolloutConfig, cluster: Cluster) -> list[dict[str, Any]]:
        rungs, previous = [], None
        for r in scale_ladder(cluster, config.model, config.proxy_model):
            rungs.append({"rung": r.name, **r.as_dict(), "iterations": config.scale_iterations,
                          "gates": rung_gates(config, r, previous)})
            previous = previous if r.skip_reason else r.model
        return rungs


def _recorded_throughput(service: AttemptService, rung: str) -> float | None:
    passed = [a for a in service.attempts("scale", rung) if a["status"] == "passed"]
    return passed[-1]["detail"].get("tokens_per_gpu") if passed else None


STAGE = Scale()
