"""The planner against Step-3.5-Flash's one-GPU slice measured on an H200 (fixtures/h200-step35.jsonl: MBS 1, 2, 4,
seq 4096, gbs 8; megatron-core 0.19.2 with the engine's Step-3.5 layers). The narrow-expert efficiency term and
the optimizer step's bytes were fitted on these rows and the proxies' (docs/planner.md, "Step-3.5-Flash's slice"),
so these hold the fit in place; the issue asked for 10 %, they are held to 5 % like the proxies' rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepdeploy.catalog import load_hardware, load_model
from stepdeploy.inventory import load_cluster
from stepdeploy.plan.cluster import ClusterShape, shape_from_cluster
from stepdeploy.plan.layout import Job, parse_layout
from stepdeploy.plan.params import count_parameters
from stepdeploy.plan.search import judge, search

FIXTURES = Path(__file__).parent / "fixtures"
ROWS = [json.loads(line) for line in (FIXTURES / "h200-step35.jsonl").read_text().splitlines() if line.strip()]


def _shape() -> ClusterShape:
    return shape_from_cluster(load_cluster(str(FIXTURES / "h200x1.ini")))


@pytest.mark.parametrize("row", ROWS, ids=[row["layout"] for row in ROWS])
def test_step_time_and_peak_within_5_percent(row: dict) -> None:
    spec = load_model(row["model"])
    verdict = judge(count_parameters(spec), Job(spec, row["seq"], row["gbs"], row["gpus"]),
                    parse_layout(row["layout"] + ",rope-fusion=off"),  # measured before the fused RoPE
                    _shape(), load_hardware())
    assert verdict.time is not None and verdict.memory is not None
    assert verdict.time.seconds == pytest.approx(row["step_s"], rel=0.05)
    assert verdict.memory.worst.torch_allocated / 2**30 == pytest.approx(row["peak_gib"], rel=0.05)


def test_the_planners_first_choice_is_the_fastest_measured_mbs() -> None:
    result = search(load_model("step-3.5-flash-slice-1gpu"), _shape(), load_hardware(), 4096, 8)
    first = result.fitting[0].layout
    fastest = min(ROWS, key=lambda row: row["step_s"])["layout"]
    assert f"mbs={first.mbs}" == fastest and (first.tp, first.pp, first.ep) == (1, 1, 1)
