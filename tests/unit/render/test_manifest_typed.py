"""One render path and one typed manifest: `stepdeploy render` and a rollout attempt both go through
render/build.py's build_run (same inputs, same hashes, the attempt adding its rung); every reader of a run
directory gets a `Manifest` from `Manifest.load`; the executor names are one list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepdeploy.errors import BadInput
from stepdeploy.executor_kinds import EXECUTOR_KINDS
from stepdeploy.inventory import load_cluster
from stepdeploy.remote import registry
from stepdeploy.render import RenderOptions
from stepdeploy.render.build import build, write_run
from stepdeploy.render.manifest import Manifest
from stepdeploy.rollout.attempt import render_attempt
from stepdeploy.rollout.ladder import Rung

from .test_render_cli import SIM_INI as INI


def inventory(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "inv.ini"
    path.write_text(INI + extra)
    return path


def test_the_cli_and_a_rollout_attempt_render_through_one_path(tmp_path: Path) -> None:
    inv = inventory(tmp_path)
    opts = RenderOptions(run_id="r1", iterations=5, seq_length=64, global_batch_size=8)
    cli = build(str(inv), "tiny-dense", "mbs=2", opts).manifest
    rung = Rung("one-node", "tiny-dense", nodes=1, nproc_per_node=1)
    summary = render_attempt(load_cluster(inv), rung, opts, "mbs=2", tmp_path / "attempt")
    attempt = Manifest.load(tmp_path / "attempt")
    # the same inputs, hashes included (the attempt used to omit them), plus the attempt's rung
    assert cli.inputs["inventory"] == attempt.inputs["inventory"]
    assert cli.inputs["inventory"]["sha256"] and cli.inputs["model"] == attempt.inputs["model"]
    assert cli.inputs["layout"]["given"] == attempt.inputs["layout"]["given"] == "mbs=2"
    assert "rung" not in cli.inputs and attempt.inputs["rung"]["nproc_per_node"] == 1
    assert summary["layout"] == attempt.layout == cli.layout
    assert attempt.node_names == ["node1"] and cli.node_names == ["node1", "node2"]
    assert attempt.inventory_path(tmp_path) == str(inv.resolve())


def test_load_reads_what_render_wrote_and_refuses_anything_else(tmp_path: Path) -> None:
    opts = RenderOptions(run_id="r2", iterations=5, seq_length=64, global_batch_size=8, stage="warmup")
    write_run(build(str(inventory(tmp_path)), "tiny-dense", None, opts), tmp_path / "run")
    manifest = Manifest.load(tmp_path / "run")
    assert (manifest.run_id, manifest.stage, manifest.engine) == ("r2", "warmup", "torch")
    assert manifest.run_dir.endswith("/r2") and [n.dir for n in manifest.nodes] == ["nodes/0-node1", "nodes/1-node2"]
    assert manifest.rung is None and manifest.executor is None
    data = json.loads((tmp_path / "run" / "manifest.json").read_text())
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({**data, "run_dir": "relative/r2"}))
    with pytest.raises(BadInput, match="run_dir"):
        Manifest.load(tmp_path / "run")
    del data["inputs"]["inventory"]
    manifest = Manifest.of(data)
    with pytest.raises(BadInput, match="names no inventory"):
        manifest.inventory_path(tmp_path / "run" / "manifest.json")


def test_a_run_rendered_for_the_local_executor_says_so_and_the_registry_reads_it(tmp_path: Path) -> None:
    inv = inventory(tmp_path)
    rendered = build(str(inv), "tiny-dense", None, RenderOptions(run_id="r3", iterations=2, executor="local"))
    assert rendered.manifest.executor == "local"
    assert registry.kind_for(rendered.manifest, load_cluster(inv)) == "local"


def test_the_executor_names_are_one_list() -> None:
    assert tuple(registry.EXECUTORS) == EXECUTOR_KINDS
    with pytest.raises(BadInput, match="unknown executor"):
        RenderOptions(run_id="r4", executor="k8s")


@pytest.mark.parametrize(("needs", "problem"), [
    ({"software": [], "python": "python3"}, "needs.software"),  # a needs entry names at least one package
    ({"software": ["transformer_engine: cp"]}, "needs.python"),  # and the interpreter the launch runs
    ({"software": "transformer_engine", "python": "python3"}, "needs.software"),
])
def test_a_manifests_needs_are_what_render_writes_or_refused(tmp_path: Path, needs: dict, problem: str) -> None:
    opts = RenderOptions(run_id="r3", iterations=5, seq_length=64, global_batch_size=8)
    write_run(build(str(inventory(tmp_path)), "tiny-dense", None, opts), tmp_path / "run")
    data = json.loads((tmp_path / "run" / "manifest.json").read_text())
    good = {"software": ["transformer_engine: TransformerEngine's attention"], "python": "python3"}
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({**data, "needs": good}))
    loaded = Manifest.load(tmp_path / "run").needs
    assert loaded is not None and loaded.software == good["software"] and loaded.python == "python3"
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({**data, "needs": needs}))
    with pytest.raises(BadInput, match=problem):
        Manifest.load(tmp_path / "run")


@pytest.mark.parametrize("case", ["sim-cpu", "hgx-h100-seed-options", "slurm-sim-cpu", "spark-roce"])
def test_the_manifest_render_built_is_the_one_written_and_the_one_read_back(tmp_path: Path, case: str) -> None:
    """One schema: the Manifest render_run built is the file it wrote (byte for byte as the golden files pin it),
    and Manifest.load reads back an equal one that writes the same file again (nulls and key order kept)."""
    from stepdeploy.render import templating

    from .cases import CASES

    rendered = CASES[case]()
    write_run(rendered, tmp_path / "run")
    loaded = Manifest.load(tmp_path / "run")
    assert loaded == rendered.manifest
    text = (tmp_path / "run" / "manifest.json").read_text()
    assert templating.render("manifest.json.j2", manifest=loaded.to_json()) == text == rendered.file(
        "manifest.json").text
    assert list(json.loads(text)) == list(loaded.to_json())  # the file's key order is the schema's


def test_a_manifest_with_keys_a_later_stepdeploy_wrote_keeps_them(tmp_path: Path) -> None:
    opts = RenderOptions(run_id="r5", iterations=5, seq_length=64, global_batch_size=8)
    write_run(build(str(inventory(tmp_path)), "tiny-dense", None, opts), tmp_path / "run")
    data = json.loads((tmp_path / "run" / "manifest.json").read_text())
    data["nodes"][0]["gpu_uuid"] = "GPU-1"
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({**data, "later": {"x": 1}}))
    assert Manifest.load(tmp_path / "run").to_json() == {**data, "later": {"x": 1}}
    del data["format"]  # render always writes it: a file without it is not one render wrote
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BadInput, match="format"):
        Manifest.load(tmp_path / "run")


def test_workload_json_is_read_back_typed(tmp_path: Path) -> None:
    from stepdeploy.render.workload_file import Workload

    opts = RenderOptions(run_id="r6", iterations=40, seq_length=64, global_batch_size=8, warmup_iterations=3)
    write_run(build(str(inventory(tmp_path)), "tiny-dense", None, opts), tmp_path / "run")
    workload = Workload.load(tmp_path / "run")
    assert (workload.training.iterations, workload.training.warmup_iterations, workload.moe) == (40, 3, {})
    data = json.loads((tmp_path / "run" / "workload.json").read_text())
    data["training"]["warmup_iterations"] = "3"
    (tmp_path / "run" / "workload.json").write_text(json.dumps(data))
    with pytest.raises(BadInput, match=r"training\.warmup_iterations"):
        Workload.load(tmp_path / "run")
