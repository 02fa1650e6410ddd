"""What the planner calls feasible, the megatron engine runs: the top layouts `plan` lists render without refusal
and pass megatron-core's own configuration checks (TransformerConfig, OptimizerConfig, DDP config built on CPU).
A subset of bench/plan_engine_matrix.py (every catalog model on every inventory: docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from stepdeploy.catalog import load_hardware, load_model
from stepdeploy.plan import engines
from stepdeploy.plan.cluster import cluster_shape
from stepdeploy.plan.layout import Job, Layout, parse_layout
from stepdeploy.plan.params import count_parameters
from stepdeploy.plan.search import judge
from tests.unit._source import bench_script

pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")

matrix = bench_script("plan_engine_matrix")


PLAN_LISTS = 10  # the layouts `stepdeploy plan` lists (its --top default): every one of them is checked


@pytest.mark.parametrize(("model", "inventory"), [
    ("proxy-0.7b-moe", "bench/inventories/h200x2.ini"),  # the first refusal: pp=2,vpp=3
    ("proxy-0.7b-dense", "bench/inventories/h200x8.ini"),
    ("tiny-moe", "inventory/examples/hgx-h100-pair.ini"),
    ("step-3.5-flash-slice-ep2", "bench/inventories/h200x2.ini"),
])
def test_every_listed_layout_renders_and_passes_megatron_cores_checks(model: str, inventory: str) -> None:
    shape = dict(matrix.clusters())[inventory]
    row = matrix.check(model, inventory, shape, top=PLAN_LISTS)
    assert row.checked == min(row.fitting, PLAN_LISTS) > 0 and row.refused == [], row


@pytest.mark.parametrize(("layout", "nodes"), [
    # the smallest Step-3.5-Flash cluster: 128 micro-batches over PP 3 run in groups of 4
    ("tp=4,pp=3,vpp=5,ep=4,etp=1,recompute=full,offload=on,precision_aware_optimizer=on,optimizer=fused", 3),
    ("tp=2,pp=4,ep=8,recompute=full", 16),  # 45 layers over 4 stages: 10/12/12/11
    ("tp=2,pp=3,vpp=3,ep=8,recompute=full,optimizer=fused", 3),  # 15 layers per stage, 5 per chunk
])
def test_step35_pipeline_layouts_the_planner_accepts_build_megatron_configs(layout: str, nodes: int) -> None:
    spec, shape = load_model("step-3.5-flash"), cluster_shape(nodes, 8, "H200", "ib-400g")
    given = parse_layout(layout)
    job = Job(spec, spec.training.seq_length, spec.training.global_batch_size, shape.world)
    verdict = judge(count_parameters(spec), job, given, shape, load_hardware())
    assert verdict.valid, verdict.violations
    assert matrix.engine_refusal(spec, verdict.layout, shape) is None


def test_vpp_group_is_pp_where_it_divides_the_micro_batches_else_the_next_size_megatron_takes() -> None:
    from stepdeploy.plan.layout import vpp_group_size

    assert vpp_group_size(64, 4) == 4
    assert vpp_group_size(128, 3) == 4  # 128 % 3 = 2 < 3 refused by megatron; 128 % 4 = 0
    assert vpp_group_size(7, 3) == 4  # 7 % 3 = 1 < 3 refused; 7 % 4 = 3 >= 3 taken (a last group of 3)
    assert vpp_group_size(2, 4) is None


def test_the_planner_never_offers_what_the_engine_refuses_and_says_why() -> None:
    step = load_model("step-3.5-flash")
    assert engines.refusal("megatron", Layout(cp=2), step) is not None
    assert "a2a or all_gather" in engines.refusal("megatron", Layout(cp=2), step)
    assert engines.refusal("megatron", Layout(pp=4, vpp=3, optimizer_cpu_offload=True), step) is None
    assert engines.refusal("megatron", Layout(tp=2, sequence_parallel=True), step) is None  # megatron-core's own SP
    assert engines.settle("megatron", Layout(tp=2)).sp  # left open: on wherever TP > 1
    assert "sequence parallelism" in engines.refusal("torch", Layout(tp=2, sequence_parallel=True), step)
    dense = load_model("gpt3-175b-seed")
    assert "any cp_comm_type" in engines.context_parallel_requirement(dense)
    assert engines.needs(step, Layout(cp=2)) and not engines.needs(step, Layout())
