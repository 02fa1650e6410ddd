"""Every Megatron rule: one layout that passes it and one that breaks it, with the reason in words."""

from __future__ import annotations

import pytest

from stepdeploy.catalog import load_model
from stepdeploy.plan.constraints import RULES, violations
from stepdeploy.plan.layout import Job, Layout

STEP = load_model("step-3.5-flash")
TINY_MOE = load_model("tiny-moe")
TINY_DENSE = load_model("tiny-dense")


def step_job(world: int, seq: int = 4096, gbs: int = 256) -> Job:
    return Job(STEP, seq, gbs, world)


# rule -> (job, passing layout, failing layout, words the reason must contain)
CASES = {
    "world-grid": (step_job(16), Layout(tp=8, pp=2, ep=8), Layout(tp=8, pp=2, cp=2), "TP*PP*CP = 32"),
    "expert-grid": (step_job(16), Layout(pp=2, ep=8), Layout(pp=2, ep=16), "ETP*EP*PP = 32"),
    "experts-per-ep": (step_job(64), Layout(ep=32), Layout(ep=64), "288 experts do not divide over EP=64"),
    "heads-per-tp": (
        step_job(64),
        Layout(tp=32),
        Layout(tp=64),
        "96 attention heads do not divide over TP=64",
    ),
    "query-groups-tp": (Job(TINY_DENSE, 256, 16, 8), Layout(tp=2), Layout(tp=6), "4 query groups"),
    "ffn-per-tp": (Job(TINY_DENSE, 256, 16, 32), Layout(tp=16), Layout(tp=32), "FFN width 688"),
    "pipeline-split": (
        step_job(8),
        Layout(pp=8),
        Layout(pp=8, first_stage_layers=2, last_stage_layers=4),
        "45 layers have no split over PP=8",
    ),
    "vpp-divides": (step_job(15), Layout(pp=5, vpp=3), Layout(pp=5, vpp=2), "a stage of 9 layers"),
    "vpp-needs-pp": (
        step_job(8),
        Layout(pp=4, vpp=3, first_stage_layers=12, last_stage_layers=9),
        Layout(vpp=3),
        "needs pipeline parallelism",
    ),
    "vpp-microbatches": (
        step_job(16, gbs=256),
        Layout(pp=4, vpp=3, mbs=1),
        Layout(pp=4, vpp=3, mbs=32),
        "2 micro-batch(es) per step, fewer than PP=4",
    ),
    "sp-needs-tp": (
        step_job(8),
        Layout(tp=2, sequence_parallel=True),
        Layout(sequence_parallel=True),
        "sequence parallel needs TP>1",
    ),
    "cp-sequence": (step_job(8, seq=4096), Layout(cp=8), Layout(cp=8), "unused"),
    "batch-divides": (step_job(16, gbs=256), Layout(mbs=2), Layout(mbs=32), "MBS*DP = 512"),
    "param-gather": (
        step_job(8),
        Layout(distributed_optimizer=True),
        Layout(distributed_optimizer=False, overlap_param_gather=True),
        "distributed optimizer",
    ),
    "cpu-offload": (
        step_job(8),
        Layout(optimizer_cpu_offload=True, precision_aware_optimizer=True),
        Layout(optimizer_cpu_offload=True),
        "precision-aware optimizer",
    ),
    "moe-comm-overlap": (
        Job(TINY_MOE, 256, 16, 4),
        Layout(ep=4, overlap_moe_expert_parallel_comm=True),
        Layout(ep=1, overlap_moe_expert_parallel_comm=True),
        "needs EP>1",
    ),
}
# cp-sequence fails through the job (sequence length), not the layout: its own test below.


def _rule(name: str):
    return next(rule for rule in RULES if rule.name == name)


def test_every_rule_has_a_case() -> None:
    assert {rule.name for rule in RULES} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_accepts_the_valid_layout(name: str) -> None:
    job, valid, _invalid, _words = CASES[name]
    assert _rule(name).check(job, valid) is None


@pytest.mark.parametrize("name", sorted(set(CASES) - {"cp-sequence"}))
def test_rule_rejects_the_invalid_layout_saying_why(name: str) -> None:
    job, _valid, invalid, words = CASES[name]
    reason = _rule(name).check(job, invalid)
    assert reason is not None and words in reason


def test_cp_needs_the_sequence_to_split_into_2cp_chunks() -> None:
    assert _rule("cp-sequence").check(step_job(8, seq=4104), Layout(cp=8)) == (
        "sequence 4104 is not a multiple of 2*CP = 16 (load-balanced causal CP)"
    )


def test_query_groups_may_be_a_divisor_of_tp() -> None:
    assert _rule("query-groups-tp").check(step_job(16), Layout(tp=16)) is None  # 8 groups divide 16


def test_moe_comm_overlap_refuses_full_recompute_and_three_mtp_layers() -> None:
    layout = Layout(ep=8, overlap_moe_expert_parallel_comm=True)
    assert "at most 1 MTP layer" in (_rule("moe-comm-overlap").check(step_job(8), layout) or "")
    full = Layout(ep=4, recompute="full", overlap_moe_expert_parallel_comm=True)
    assert "full recompute" in (_rule("moe-comm-overlap").check(Job(TINY_MOE, 256, 16, 4), full) or "")


def test_seed_layout_on_a_dense_model_breaks_the_expert_rule_only() -> None:
    seed = Job(load_model("gpt3-175b-seed"), 2048, 64, 16)
    found = violations(seed, Layout(tp=8, pp=2, ep=4))
    assert [v.rule for v in found] == ["experts-per-ep"]
    assert found[0].reason == "EP=4 ETP=1 on a dense model (no experts)"
