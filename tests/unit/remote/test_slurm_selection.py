"""Choosing the slurm executor (inventory or option), rendering its batch script only then, refusing values
that cannot go into #SBATCH lines, and finding the controller host. No connection is made here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stepdeploy.catalog import load_model
from stepdeploy.errors import BadInput
from stepdeploy.inventory import load_cluster
from stepdeploy.inventory.model import Cluster, Node, SlurmSettings, SshSettings
from stepdeploy.plan.layout import Layout
from stepdeploy.remote.fabric_executor import FabricExecutor
from stepdeploy.remote.slurm_executor import JOBS_FILE, SlurmExecutor, controller_endpoint
from stepdeploy.render import RenderedRun, RenderOptions, render_run
from stepdeploy.rollout.attempt import executor_for
from tests.unit.render.cases import CREATED, INPUTS, SOURCES, VERSION, cpu_nodes

INVENTORY = """[gpu]
node1 ansible_host=10.90.0.11
node2 ansible_host=10.90.0.12
[gpu:vars]
stepdeploy_gpus_per_node=0
{extra}
"""


def inventory(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "inv.ini"
    path.write_text(INVENTORY.format(extra=extra))
    return path


def render(cluster: Cluster, **opts: Any) -> RenderedRun:

    options = RenderOptions(run_id="sel", iterations=4, seq_length=64, global_batch_size=8, **opts)
    return render_run(cluster, load_model("tiny-dense"), Layout(mbs=2), options, inputs=INPUTS, created=CREATED,
                      version=VERSION, workload_sources=SOURCES)


def test_inventory_selects_slurm_with_its_settings(tmp_path: Path) -> None:
    cluster = load_cluster(inventory(tmp_path, "stepdeploy_executor=slurm\nstepdeploy_slurm_controller=node2\n"
                                                "stepdeploy_slurm_partition=train\nstepdeploy_slurm_tasks=gpu"))
    assert cluster.executor == "slurm"
    assert cluster.slurm == SlurmSettings(controller="node2", partition="train", tasks="gpu")


def test_no_executor_variable_means_fabric(tmp_path: Path) -> None:
    cluster = load_cluster(inventory(tmp_path, ""))
    assert cluster.executor is None and cluster.slurm == SlurmSettings()


@pytest.mark.parametrize(("extra", "message"), [
    ("stepdeploy_executor=k8s",
     "stepdeploy_executor = 'k8s' is not a known value; use one of fabric, local, slurm"),
    ("stepdeploy_slurm_tasks=rank", "stepdeploy_slurm_tasks = 'rank' is not a known value; use one of gpu, node"),
    ("stepdeploy_slurm_partition='a b'", "is not a Slurm partition name"),
    ("stepdeploy_slurm_controller='no;such host'", "is not an address"),
    ("stepdeploy_slurm_tasks_per_node=1", "is not a stepdeploy variable"),
])
def test_bad_settings_are_one_line_naming_the_variable(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_cluster(inventory(tmp_path, extra))


def test_the_executor_is_one_setting_for_the_whole_cluster(tmp_path: Path) -> None:
    path = tmp_path / "inv.ini"
    path.write_text("[g]\nnode1 ansible_host=10.0.0.1 stepdeploy_executor=slurm\nnode2 ansible_host=10.0.0.2\n")
    with pytest.raises(BadInput, match=r"stepdeploy_executor differs between hosts \(node1=slurm, node2=\(none\)\)"):
        load_cluster(path)


def test_fabric_runs_have_no_batch_script_and_an_unchanged_manifest() -> None:
    rendered = render(Cluster(source=Path("x.ini"), nodes=cpu_nodes()))
    assert "sbatch.sh" not in {f.path for f in rendered.files}
    manifest = json.loads(rendered.file("manifest.json").text)
    assert "executor" not in manifest and "slurm" not in manifest


def test_the_option_overrides_the_inventory_both_ways() -> None:
    slurm_inventory = Cluster(source=Path("x.ini"), nodes=cpu_nodes(), executor="slurm")
    assert "sbatch.sh" not in {f.path for f in render(slurm_inventory, executor="fabric").files}
    plain = Cluster(source=Path("x.ini"), nodes=cpu_nodes())
    rendered = render(plain, executor="slurm", stage="soak")
    manifest = json.loads(rendered.file("manifest.json").text)
    assert manifest["executor"] == "slurm"
    assert manifest["slurm"] == {"script": "sbatch.sh", "job_name": "sd-soak-sel", "tasks": "node",
                                 "tasks_per_node": 1, "partition": None}
    listed = {f["path"]: f for f in manifest["files"]}
    assert listed["sbatch.sh"]["from"] == "templates/sbatch.sh.j2"
    assert rendered.file("sbatch.sh").executable


def test_an_unknown_executor_option_is_refused() -> None:
    with pytest.raises(BadInput, match=r"unknown executor 'k8s'; use fabric \(SSH\), slurm \(sbatch\) "
                                       r"or local \(this machine, no SSH\)"):
        RenderOptions(run_id="x", executor="k8s")


def test_values_that_cannot_go_into_sbatch_lines_are_refused() -> None:
    odd = [Node(name="node 1", address="10.0.0.1", gpus_per_node=0), Node(name="n2", address="10.0.0.2",
                                                                           gpus_per_node=0)]
    with pytest.raises(BadInput, match="cannot be a Slurm node name"):
        render(Cluster(source=Path("x.ini"), nodes=odd, executor="slurm"))
    with pytest.raises(BadInput, match=r"cannot go into an #SBATCH line"):
        render(Cluster(source=Path("x.ini"), nodes=cpu_nodes(), executor="slurm"), remote_dir="/runs/a b")


def test_the_controller_is_a_node_by_name_another_host_or_the_first_node() -> None:
    ssh = SshSettings(user="ops", port=2222, private_key_file=Path("/k"), known_hosts_file=Path("/kh"))
    nodes = [Node(name=f"n{i}", address=f"10.0.0.{i}", ssh=ssh) for i in (1, 2)]
    first = controller_endpoint(Cluster(source=Path("x"), nodes=nodes))
    assert (first.host, first.user, first.port) == ("10.0.0.1", "ops", 2222)
    named = controller_endpoint(Cluster(source=Path("x"), nodes=nodes, slurm=SlurmSettings(controller="n2")))
    assert named.host == "10.0.0.2"
    login = controller_endpoint(Cluster(source=Path("x"), nodes=nodes, slurm=SlurmSettings(controller="login1")))
    assert (login.host, login.user, login.port, login.known_hosts) == ("login1", "ops", 2222, Path("/kh"))


def test_the_rollout_drives_a_run_with_the_executor_it_was_rendered_for(tmp_path: Path) -> None:
    from stepdeploy.render.build import write_run

    cluster = Cluster(source=Path("x.ini"), nodes=cpu_nodes())
    write_run(render(cluster), tmp_path / "attempts" / "fabric")
    write_run(render(cluster, executor="slurm"), tmp_path / "attempts" / "slurm")
    with executor_for(cluster, tmp_path / "attempts" / "fabric") as fabric:
        assert isinstance(fabric, FabricExecutor)
    with executor_for(cluster, tmp_path / "attempts" / "slurm") as slurm:
        assert isinstance(slurm, SlurmExecutor)
        assert slurm.job_name == "sd-warmup-sel" and [t.name for t in slurm.targets] == ["node1", "node2"]
        assert slurm.jobs_file == tmp_path / "attempts" / "slurm" / JOBS_FILE
        assert slurm.job_ids() == []
        slurm.jobs_file.write_text("5\n6\n")
        assert slurm.job_ids() == ["5", "6"]


def test_job_events_reach_the_rollouts_ledger_through_the_callers_callback(tmp_path: Path) -> None:
    """slurm_executor knows no ledger: the rollout (attempt.executor_for) passes a callback that records the
    job's events in its ledger, kind slurm, with the attempt's stage and rung; `run` passes none."""
    from stepdeploy.ledger import Ledger
    from stepdeploy.render.build import write_run

    cluster = Cluster(source=Path("x.ini"), nodes=cpu_nodes())
    write_run(render(cluster, executor="slurm"), tmp_path / "attempts" / "a1")
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.create_run("r1", {}, ["warmup"])
    with executor_for(cluster, tmp_path / "attempts" / "a1") as slurm:
        slurm.on_event("slurm job 5 submitted (sd-warmup-sel)", {"job_id": "5"})
    [event] = [e for e in ledger.events("r1") if e["kind"] == "slurm"]
    assert event["message"] == "slurm job 5 submitted (sd-warmup-sel)" and event["stage"] == "warmup"
    from stepdeploy.cli.run import executor_for_run_dir

    with executor_for_run_dir(tmp_path / "attempts" / "a1", str(inventory(tmp_path, ""))) as plain:
        plain.on_event("not recorded", {})
    assert [e["message"] for e in ledger.events("r1") if e["kind"] == "slurm"] == [event["message"]]
