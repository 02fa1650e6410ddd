"""`stepdeploy plan` end to end through the console-script entry point (exit codes, stdout, JSON)."""

from __future__ import annotations

import json

import pytest

from stepdeploy.cli.app import main
from stepdeploy.plan.cluster import shape_from_cluster


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.out, captured.err


SEED_CLUSTER = ("--nodes", "2", "--gpus-per-node", "8", "--gpu", "H200", "--link", "ib-400g")


def test_seed_layout_is_rejected_with_its_reason_and_alternatives(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-m", "gpt3-175b-seed", *SEED_CLUSTER, "--layout", "tp=8,pp=2,ep=4")
    assert code == 1
    assert "INVALID" in out and "EP=4 ETP=1 on a dense model (no experts)" in out
    assert "Feasible alternatives" in out and "Best layouts" in out


def test_seed_layout_without_ep_runs_out_of_memory_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "-m", "gpt3-175b-seed", *SEED_CLUSTER, "--layout", "tp=8,pp=2,dist-opt=off", "--json"
    )
    data = json.loads(out)
    assert code == 1
    assert data["layout"]["valid"] and not data["layout"]["fits"]
    assert data["layout"]["reason"] == "out of memory on stage 0 (largest: optimizer)"
    assert data["alternatives"]["fitting_count"] > 0


def test_a_tiny_model_fits_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "-m",
        "tiny-moe",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--gpu",
        "H100",
        "--top",
        "3",
        "--json",
    )
    data = json.loads(out)
    assert code == 0 and len(data["fitting"]) == 3 and "searching layouts" in err


def test_explain_prints_the_per_layer_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-m", "step-3.5-flash", "--explain")
    assert code == 0
    assert "total 197.800B = main model 196.956B + MTP 0.844B" in out
    assert "11: 4-44 every 4" in out  # full-attention MoE layers grouped
    assert "3,5-7,9-11" in out  # sliding-window MoE layers, in runs


def test_no_cluster_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "-m", "tiny-dense")
    assert code == 2 and "say which cluster" in err


def test_unknown_gpu_is_bad_input_listing_the_known(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "-m", "tiny-dense", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "A100")
    assert code == 2 and "known: B200, GB10, H100, H200" in err


class _Node:
    def __init__(self, gpu_model: str | None, gpus: int = 8, fabric: str = "infiniband") -> None:
        self.gpu_model, self.gpus_per_node, self.fabric = gpu_model, gpus, fabric


class _Cluster:
    def __init__(self, *nodes: _Node) -> None:
        self.nodes = list(nodes)


def test_shape_from_an_inventory_cluster() -> None:
    shape = shape_from_cluster(_Cluster(_Node("GB10", 1, "roce"), _Node("GB10", 1, "roce")))
    assert (shape.nodes, shape.gpus_per_node, shape.gpu.name, shape.inter_node_link.name) == (
        2,
        1,
        "GB10",
        "roce-200g",
    )


def test_mixed_nodes_and_unknown_gpu_are_refused() -> None:
    from stepdeploy.errors import BadInput

    with pytest.raises(BadInput, match="GPU model differs across nodes: H100 x1, H200 x1"):
        shape_from_cluster(_Cluster(_Node("H100"), _Node("H200")))
    with pytest.raises(BadInput, match="does not say which GPU"):
        shape_from_cluster(_Cluster(_Node(None)))


@pytest.mark.parametrize("args", [
    ("-m", "tiny-moe", "--explain", "--json"),
    ("-m", "tiny-moe", "--nodes", "1", "--gpus-per-node", "2", "--gpu", "H100", "--explain", "--json"),
    ("-m", "tiny-moe", "--nodes", "1", "--gpus-per-node", "2", "--gpu", "H100", "--explain", "--json",
     "--layout", "tp=2"),
    ("-m", "tiny-moe", "--nodes", "1", "--gpus-per-node", "2", "--gpu", "H100", "--json"),
])
def test_json_is_exactly_one_document_explain_included(capsys: pytest.CaptureFixture[str],
                                                        args: tuple[str, ...]) -> None:
    _, out, _ = run(capsys, *args)
    decoder = json.JSONDecoder()
    data, end = decoder.raw_decode(out)
    assert out[end:].strip() == "", f"more than one JSON document on stdout: {out[end:end + 200]!r}"
    if "--explain" in args:
        parameters = data if "--nodes" not in args else data["parameters"]
        assert parameters["total"] > 0 and parameters["layers"]


def test_explain_says_what_the_engine_does_not_run_and_why_and_no_listed_layout_uses_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 22 item 1: where the engine cannot run something the planner does not offer it, and --explain says
    why (text and --json); the layouts it would need are counted under the rule `engine`."""
    cluster = ("-m", "step-3.5-flash-slice-ep2", "--nodes", "1", "--gpus-per-node", "4", "--gpu", "H200")
    code, out, _ = run(capsys, *cluster, "--explain")
    assert code == 0
    assert "What the megatron engine runs (the layouts above are only those):" in out
    assert "  - context parallel: not offered: context parallelism splits attention" in out
    assert "  - sequence parallel: runs: megatron-core's own sequence_parallel (TransformerConfig)" in out
    assert "needs TransformerEngine's attention with cp_comm_type a2a or all_gather for its sliding windows" in out
    code, out, _ = run(capsys, *cluster, "--explain", "--json", "--top", "100")
    data = json.loads(out)
    assert any(line.startswith("context parallel: not offered") for line in data["engine"]["capabilities"])
    assert data["rejected"]["engine"]["count"] > 0
    assert data["rejected"]["engine"]["rule"] == "the engine does not run it (stepdeploy/data/engines.yaml)"
    assert "the megatron engine" in data["rejected"]["engine"]["example"]["reason"]
    assert data["fitting"] and all(f["layout"]["cp"] == 1 and f["needs"] == [] for f in data["fitting"])
