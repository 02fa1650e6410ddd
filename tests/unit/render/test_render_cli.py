"""`stepdeploy render` end to end on an inventory file: exit codes, dry-run, refusals, the JSON manifest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stepdeploy.cli.app import app
from stepdeploy.errors import BadInput
from stepdeploy.render.options import RenderOptions

SIM_INI = """[sim]
node1 ansible_host=10.83.0.11
node2 ansible_host=10.83.0.12

[sim:vars]
ansible_user=root
stepdeploy_gpus_per_node=0
stepdeploy_profile=sim-cpu
stepdeploy_train_iface=eth0
stepdeploy_fabric=ethernet
"""
H200_INI = """[gpu]
h200 ansible_host=192.0.2.9

[gpu:vars]
stepdeploy_gpus_per_node=2
stepdeploy_gpu_model=H200
stepdeploy_fabric=ethernet
"""


def run(tmp_path: Path, text: str, *args: str) -> object:
    inventory = tmp_path / "inv.ini"
    inventory.write_text(text)
    return CliRunner().invoke(app, ["render", "-i", str(inventory), *args])


def test_render_writes_the_run_directory_and_its_manifest(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "r1"
    res = run(tmp_path, SIM_INI, "-m", "tiny-dense", "--out", str(out), "--run-id", "r1", "--json")
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine"] == "torch" and [n["name"] for n in manifest["nodes"]] == ["node1", "node2"]
    assert (out / "nodes/0-node1/launch.sh").stat().st_mode & 0o111
    assert json.loads((out / "workload.json").read_text())["world_size"] == 2


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "r2"
    res = run(tmp_path, SIM_INI, "-m", "tiny-moe", "--out", str(out), "--dry-run")
    assert res.exit_code == 0, res.output
    assert "would write" in res.output and not out.exists()


def test_existing_run_directory_is_never_rewritten(tmp_path: Path) -> None:
    out = tmp_path / "r3"
    out.mkdir()
    (out / "keep").write_text("x")
    res = run(tmp_path, SIM_INI, "-m", "tiny-dense", "--out", str(out))
    assert isinstance(res.exception, BadInput) and "not empty" in res.exception.message


def test_torch_engine_refuses_model_parallel_layouts(tmp_path: Path) -> None:
    res = run(tmp_path, SIM_INI, "-m", "tiny-dense", "--out", str(tmp_path / "r4"), "--layout", "tp=2")
    assert isinstance(res.exception, BadInput) and "data-parallel only" in res.exception.message


def test_gpu_inventory_gets_the_planners_layout_for_the_megatron_engine(tmp_path: Path) -> None:
    out = tmp_path / "r5"
    res = run(tmp_path, H200_INI, "-m", "proxy-0.7b-moe", "--out", str(out), "--no-nvls")
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine"] == "megatron" and manifest["inputs"]["layout"]["planner"] == "chosen"
    workload = json.loads((out / "workload.json").read_text())
    assert workload["parallel"]["cp"] == 1 and workload["parallel"]["experts"] == "grouped_mm"
    assert workload["parallel"]["sequence_parallel"] is False and workload["parallel"]["cross_entropy_fusion"] is True
    assert workload["parallel"]["rope_fusion"] is True
    assert workload["peak_tflops"] == 790.0
    assert "NCCL_NVLS_ENABLE=0" in (out / "nodes/0-h200/env.sh").read_text()


def test_tensor_parallel_renders_with_sequence_parallelism_unless_told_not_to(tmp_path: Path) -> None:
    """Issue 38 item 3: megatron-core's own sequence parallelism wherever TP > 1 (the engine's norms run under it);
    sp=off turns it off; a sequence that does not split over TP runs TP without it, and sp=on then says why."""
    def parallel(name: str, *args: str) -> dict[str, Any]:
        res = run(tmp_path, H200_INI, "-m", "proxy-0.7b-dense", "--out", str(tmp_path / name), *args)
        assert res.exit_code == 0, res.output
        return json.loads((tmp_path / name / "workload.json").read_text())["parallel"]

    assert {"tp": 2, "sequence_parallel": True}.items() <= parallel("tp", "--layout", "tp=2,mbs=4").items()
    assert parallel("sp", "--layout", "tp=2,sp=on")["sequence_parallel"] is True
    assert parallel("off", "--layout", "tp=2,mbs=4,sp=off")["sequence_parallel"] is False
    assert parallel("dp", "--layout", "tp=1,mbs=4")["sequence_parallel"] is False
    assert parallel("odd", "--layout", "tp=2,mbs=4", "--seq", "511")["sequence_parallel"] is False
    res = run(tmp_path, H200_INI, "-m", "proxy-0.7b-dense", "--out", str(tmp_path / "odd-sp"), "--layout",
              "tp=2,sp=on", "--seq", "511")
    assert isinstance(res.exception, BadInput) and "not a multiple" in res.exception.message
    assert not (tmp_path / "odd-sp").exists()


def test_invalid_layout_names_the_rule(tmp_path: Path) -> None:
    res = run(tmp_path, H200_INI, "-m", "proxy-0.7b-dense", "--out", str(tmp_path / "r6"), "--layout", "ep=2")
    assert isinstance(res.exception, BadInput) and "cannot run" in res.exception.message


def test_learning_rate_is_the_models_unless_given(tmp_path: Path) -> None:
    def lr(text: str, model: str, *args: str) -> float:
        out = tmp_path / f"run-{model}-{len(args)}"
        result = run(tmp_path, text, "-m", model, "--out", str(out), *args)
        assert result.exit_code == 0, result.output
        return json.loads((out / "workload.json").read_text())["training"]["lr"]

    assert lr(H200_INI, "proxy-0.7b-dense") == 2.5e-4  # the catalog's (3e-3 diverged on the H200)
    assert lr(H200_INI, "proxy-0.7b-dense", "--lr", "1e-4") == 1e-4
    assert lr(SIM_INI, "tiny-dense") == 3e-3  # no catalog lr: the default for the tiny CPU models
    refused = run(tmp_path, SIM_INI, "-m", "tiny-dense", "--out", str(tmp_path / "bad"), "--lr", "0")
    assert isinstance(refused.exception, BadInput) and "learning rate" in refused.exception.message
    assert refused.exception.exit_code == 2
    assert not (tmp_path / "bad").exists()


H200_NODES_INI = """[gpu]
{hosts}

[gpu:vars]
stepdeploy_gpus_per_node=8
stepdeploy_gpu_model=H200
stepdeploy_fabric=infiniband
stepdeploy_profile={profile}
"""


def _nodes(count: int, profile: str = "hopper-cu130") -> str:
    hosts = "\n".join(f"h{i} ansible_host=192.0.2.{i + 1}" for i in range(count))
    return H200_NODES_INI.format(hosts=hosts, profile=profile)


def test_step_35_flash_renders_where_it_fits_with_every_layer_described(tmp_path: Path) -> None:
    """Once refused ("per-head attention gates and sliding windows are not in stock megatron-core")."""
    out = tmp_path / "s35"
    res = run(tmp_path, _nodes(4), "-m", "step-3.5-flash", "--out", str(out), "--no-nvls")
    assert res.exit_code == 0, res.output
    workload = json.loads((out / "workload.json").read_text())
    layers, mtp = workload["model"]["layers"], workload["model"]["mtp_layers"]
    assert len(layers) == 45 and len(mtp) == 3 and not workload["model"]["uniform_attention"]
    assert [(x["attention"], x["num_heads"], x["window"]) for x in layers[:2]] == [("full", 64, None),
                                                                                 ("sliding", 96, 512)]
    assert (layers[44]["swiglu_limit"], layers[44]["shared_swiglu_limit"]) == (7.0, 16.0)
    assert workload["parallel"]["experts"] == "grouped_mm"  # clamped experts run only as grouped GEMMs
    assert workload["parallel"]["vpp"] == 1 and workload["parallel"]["cp"] == 1


def test_a_profile_without_flex_attention_is_refused_for_sliding_windows(tmp_path: Path) -> None:
    res = run(tmp_path, _nodes(1, "seed-2024"), "-m", "step-3.5-flash-slice-1gpu", "--out", str(tmp_path / "x"))
    assert isinstance(res.exception, BadInput), res.output
    assert "PyTorch 2.3.1 — needs >= 2.5 for sliding-window attention" in res.exception.message
    assert "hopper-cu130" in (res.exception.hint or "") and not (tmp_path / "x").exists()


def test_keep_checkpoints_reaches_the_workload_and_must_keep_one(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "keep"
    res = run(tmp_path, SIM_INI, "-m", "tiny-dense", "--out", str(out), "--keep-checkpoints", "3")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "workload.json").read_text())["training"]["keep_checkpoints"] == 3
    res = run(tmp_path, SIM_INI, "-m", "tiny-dense", "--out", str(tmp_path / "k0"), "--keep-checkpoints", "0")
    assert res.exit_code == 2 and not (tmp_path / "k0").exists()
    with pytest.raises(BadInput, match="keep-checkpoints 0"):
        RenderOptions(run_id="r", keep_checkpoints=0)


def test_warmup_iterations_reach_the_workload_else_a_tenth(tmp_path: Path) -> None:
    def training(name: str, *args: str) -> dict:
        out = tmp_path / name
        res = run(tmp_path, SIM_INI, "-m", "tiny-dense", "--out", str(out), "--iterations", "75", *args)
        assert res.exit_code == 0, res.output
        return json.loads((out / "workload.json").read_text())["training"]

    assert training("tenth")["warmup_iterations"] == 7
    given = training("given", "--warmup-iterations", "50")
    assert given["warmup_iterations"] == 50 and given["iterations"] == 75
    res = run(tmp_path, SIM_INI, "-m", "tiny-dense", "--out", str(tmp_path / "w0"), "--warmup-iterations", "0")
    assert res.exit_code == 2 and not (tmp_path / "w0").exists()
