"""metrics.jsonl lines: the same keys for both engines, the megatron engine's phase timings only when given."""

from __future__ import annotations

import json
from pathlib import Path

from metrics import METRIC_KEYS, RankFiles  # tests/unit/workload/conftest.py puts the workload directory on sys.path


def test_every_line_has_the_common_keys_and_optional_ones_only_when_given(tmp_path: Path) -> None:
    files = RankFiles(tmp_path, 0)
    files.record({"iteration": 1, "loss": 2.5, "forward_backward_s": 0.5, "optimizer_s": 0.1, "profiled": True,
                  "unknown": 7})
    files.record({"iteration": 2, "loss": 2.4})
    first, second = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert set(METRIC_KEYS) <= set(first) and set(METRIC_KEYS) == set(second)
    assert (first["forward_backward_s"], first["optimizer_s"], first["profiled"]) == (0.5, 0.1, True)
    assert "unknown" not in first and first["grad_norm"] is None and second["loss"] == 2.4


def test_router_stats_summarise_load_dropped_and_bias_per_layer() -> None:
    import torch
    from moe_stats import RouterStats, summarise

    counts = torch.tensor([[0.0, 0.0, 0.0, 0.0], [4.0, 4.0, 4.0, 4.0], [10.0, 2.0, 2.0, 2.0]])
    present = torch.tensor([0.0, 1.0, 1.0])  # layer 1 is dense: no router on any rank
    out = summarise(counts, torch.tensor([0.0, 16.0, 20.0]), present, torch.tensor([0.0, 0.01, -0.0]), True)
    assert out["moe_load"] == {"2": 1.0, "3": 2.5} and out["moe_load_max"] == 2.5
    assert abs(out["moe_dropped"] - 4 / 36) < 1e-6  # 32 of the 36 assignments asked for were routed
    assert out["router_bias"] == {"2": 0.01, "3": 0.0} and out["router_bias_absmax"] == 0.01
    assert "router_bias" not in summarise(counts, torch.zeros(3), present, torch.zeros(3), False)
    assert summarise(counts, torch.zeros(3), present, torch.zeros(3), False, ceiling=32 / 8)["moe_load_ceiling"] == 4

    stats = RouterStats(slots=2, experts=2, topk=1, device="cpu")  # no process group: this rank's counts alone
    stats.present[1] = 1.0
    stats.add(1, torch.tensor([3, 1]), tokens=4)
    with torch.no_grad():
        stats.add(1, torch.tensor([100, 0]), tokens=100)  # an evaluation pass: not counted
    assert stats.reduce()["moe_load"] == {"2": 1.5} and stats.counts.sum() == 0


def test_router_stats_read_megatrons_load_balancing_loss_per_layer_averaged_over_micro_batches() -> None:
    """What megatron-core's routers put in its tracker (its own save function, as TopKRouter calls it once per
    micro-batch) comes out per MoE layer, divided by the micro-batches; the tracker is cleared for the next step;
    a model whose routers add no auxiliary loss (the expert bias alone) records none."""
    import torch
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        save_to_aux_losses_tracker,
    )
    from moe_stats import RouterStats

    tracker = get_moe_layer_wise_logging_tracker()
    tracker.pop("load_balancing_loss", None)
    stats = RouterStats(slots=3, experts=4, topk=2, device="cpu", micro_batches=2)
    stats.present[1] = stats.present[2] = 1.0  # layer 1 is dense
    assert "moe_aux_loss" not in stats.reduce()  # no router added a loss
    for micro in (1.0, 1.5):  # two micro-batches through layers 2 and 3
        save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(micro), 2, 3)
        save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(2 * micro), 3, 3)
    out = stats.reduce()
    assert out["moe_aux_loss"] == {"2": 1.25, "3": 2.5} and out["moe_aux_loss_mean"] == 1.875
    assert float(tracker["load_balancing_loss"]["values"].abs().sum()) == 0.0  # cleared for the next step
    assert stats.reduce()["moe_aux_loss"] == {"2": 0.0, "3": 0.0}  # a step whose routers added nothing
    clear_aux_losses_tracker()
    tracker.pop("load_balancing_loss", None)


def test_the_heartbeat_says_saving_while_a_save_blocks_and_stops_beating_past_the_limit(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    import time

    import metrics

    monkeypatch.setattr(metrics, "SAVE_BEAT_S", 0.05)
    files = RankFiles(tmp_path, 1)

    def beat() -> dict:
        return json.loads((tmp_path / "heartbeat" / "rank1").read_text())

    files.beat(7)
    assert "state" not in beat()  # a training beat: as before (the monitors read iteration, time, pid)
    with files.saving(7):
        first = beat()
        assert first["state"] == "saving" and first["iteration"] == 7
        time.sleep(0.3)
        assert beat()["time"] > first["time"]  # rewritten while the save blocks: not a hang
    after = beat()
    assert "state" not in after and after["iteration"] == 7
    with files.saving(8, limit_s=0.1):  # a save stuck past the limit: the beats stop, the hang timeout can fire
        time.sleep(0.3)
        stale = beat()["time"]
        time.sleep(0.3)
        assert beat()["time"] == stale
