"""The inter-node bandwidth the planner assumes comes from the inventory's HCAs: how many each node has
(stepdeploy_ib_hcas) and their rate (stepdeploy_ib_rate), not the catalog's one 400G NIC per GPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from stepdeploy.catalog import load_hardware, load_model
from stepdeploy.errors import BadInput
from stepdeploy.inventory import load_cluster
from stepdeploy.plan.cluster import cluster_shape, shape_from_cluster
from stepdeploy.plan.layout import Job, Layout
from stepdeploy.plan.params import count_parameters
from stepdeploy.plan.steptime import predict_step_time

REPO = Path(__file__).resolve().parents[3]
NDR_PER_NIC = 48.0  # hardware.yaml ib-400g busbw: one 400G NIC


def inventory(tmp_path: Path, hcas: int, rate: str = "", fabric: str = "infiniband") -> Path:
    path = tmp_path / "inv.ini"
    devices = ",".join(f"mlx5_{k}" for k in range(hcas))
    path.write_text(f"[gpu]\na ansible_host=192.0.2.1\nb ansible_host=192.0.2.2\n\n[gpu:vars]\n"
                    f"stepdeploy_gpus_per_node=8\nstepdeploy_gpu_model=H200\nstepdeploy_fabric={fabric}\n"
                    + (f"stepdeploy_ib_hcas={devices}\n" if hcas else "") + rate)
    return path


def test_the_seed_inventorys_four_hcas_are_half_the_bandwidth_of_eight() -> None:
    dgx = shape_from_cluster(load_cluster(str(REPO / "inventory/dgx.ini")))
    hgx = shape_from_cluster(load_cluster(str(REPO / "inventory/examples/hgx-h100-pair.ini")))
    assert dgx.hcas_per_node == 4 and hgx.hcas_per_node == 8
    assert dgx.inter_node_busbw_gbps() == NDR_PER_NIC / 2
    assert hgx.inter_node_busbw_gbps() == NDR_PER_NIC
    assert "(4 x 400 Gb/s HCAs per node)" in dgx.describe()


def test_the_hca_rate_scales_the_bandwidth(tmp_path: Path) -> None:
    shape = shape_from_cluster(load_cluster(str(inventory(tmp_path, 8, "stepdeploy_ib_rate=200\n"))))
    assert shape.hca_rate_gbit == 200 and shape.inter_node_busbw_gbps() == NDR_PER_NIC / 2
    assert "(8 x 200 Gb/s HCAs per node)" in shape.describe()


def test_no_hcas_named_keeps_the_links_own_assumption(tmp_path: Path) -> None:
    shape = shape_from_cluster(load_cluster(str(inventory(tmp_path, 0))))
    assert shape.hcas_per_node is None and shape.inter_node_busbw_gbps() == NDR_PER_NIC
    assert shape.inter_node_busbw_gbps() == cluster_shape(2, 8, "H200", "ib-400g").inter_node_busbw_gbps()


def test_more_hcas_than_gpus_give_a_gpu_no_more_than_one() -> None:
    shape = cluster_shape(2, 4, "H200", "ib-400g")
    assert shape.inter_node_busbw_gbps() == NDR_PER_NIC
    assert replace(shape, hcas_per_node=8).inter_node_busbw_gbps() == NDR_PER_NIC


def test_a_spark_pairs_split_port_is_not_counted_twice() -> None:
    spark = shape_from_cluster(load_cluster(str(REPO / "inventory/examples/dgx-spark-pair.yml")))
    assert spark.hcas_per_node is None and spark.inter_node_busbw_gbps() == 23.7


def test_fewer_hcas_make_data_parallel_steps_slower(tmp_path: Path) -> None:
    spec, hardware = load_model("proxy-0.7b-dense"), load_hardware()
    four = shape_from_cluster(load_cluster(str(inventory(tmp_path, 4))))
    eight = shape_from_cluster(load_cluster(str(inventory(tmp_path, 8))))
    job, layout = Job(spec, 2048, 32, 16), Layout(mbs=2)
    params = count_parameters(spec)
    slow, fast = (predict_step_time(params, job, layout, shape, hardware) for shape in (four, eight))
    assert slow.seconds > fast.seconds


def test_a_bad_rate_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="stepdeploy_ib_rate = '400G' is not a whole number"):
        load_cluster(str(inventory(tmp_path, 8, "stepdeploy_ib_rate=400G\n")))
