"""Sequence lengths as megatron-core takes them: any length without context parallelism, a multiple of 2*CP with
it, and never more than the model's max_position_embeddings (bad input, exit 2, before any search)."""

from __future__ import annotations

import json

import pytest

from stepdeploy.catalog import load_hardware, load_model
from stepdeploy.cli.app import main
from stepdeploy.errors import BadInput
from stepdeploy.plan.cluster import cluster_shape
from stepdeploy.plan.constraints import violations
from stepdeploy.plan.layout import Job, Layout, check_sequence
from stepdeploy.plan.search import search


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.out, captured.err


EIGHT_H200 = ("--nodes", "1", "--gpus-per-node", "8", "--gpu", "H200")


@pytest.mark.parametrize("seq", [509, 510, 511, 512])
def test_odd_and_even_sequences_fit_without_context_parallelism(seq: int) -> None:
    spec = load_model("tiny-dense")
    result = search(spec, cluster_shape(1, 8, "H200", "ib-400g"), load_hardware(), seq, 16)
    assert result.fitting, f"nothing fits at seq {seq}: {dict(result.rejected)}"
    assert all(verdict.layout.cp == 1 for verdict in result.fitting if seq % 2)


def test_the_2cp_rule_holds_only_with_context_parallelism() -> None:
    job = Job(load_model("tiny-dense"), 511, 16, 8)
    assert not [v for v in violations(job, Layout(cp=1)) if v.rule == "cp-sequence"]
    broken = [v.reason for v in violations(job, Layout(cp=2)) if v.rule == "cp-sequence"]
    assert broken == ["sequence 511 is not a multiple of 2*CP = 4 (load-balanced causal CP)"]


def test_plan_json_fits_an_odd_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan(capsys, "-m", "tiny-dense", *EIGHT_H200, "--seq", "511", "--json")
    assert code == 0 and json.loads(out)["fitting_count"] > 0


def test_a_sequence_beyond_the_models_positions_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan(capsys, "-m", "tiny-dense", *EIGHT_H200, "--seq", "1024")
    assert code == 2 and out == ""
    assert "error: sequence length 1024 exceeds tiny-dense's max_position_embeddings 512" in err
    assert "hint: give --seq 512 or less" in err and "searching" not in err
    assert plan(capsys, "-m", "tiny-dense", *EIGHT_H200, "--seq", "512")[0] == 0


def test_check_sequence_takes_the_maximum_itself() -> None:
    spec = load_model("tiny-dense")
    check_sequence(spec, spec.max_position_embeddings)
    with pytest.raises(BadInput, match="exceeds"):
        check_sequence(spec, spec.max_position_embeddings + 1)
