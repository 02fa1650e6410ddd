"""The infiniband role's NCCL facts module against recorded sysfs layouts (no RDMA hardware here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

MODULE = Path(__file__).resolve().parents[2] / "roles/infiniband/library/stepdeploy_nccl_facts.py"
_spec = importlib.util.spec_from_file_location("stepdeploy_nccl_facts", MODULE)
assert _spec and _spec.loader
nccl_facts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nccl_facts)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _netdev(root: Path, name: str, state: str = "up", mtu: int = 9000) -> None:
    _write(root, f"class/net/{name}/operstate", state)
    _write(root, f"class/net/{name}/mtu", str(mtu))


def _roce_port(root: Path, dev: str, netdev: str, state: str = "4: ACTIVE") -> None:
    port = f"class/infiniband/{dev}/ports/1"
    _write(root, f"{port}/state", state)
    _write(root, f"{port}/phys_state", "5: LinkUp")
    _write(root, f"{port}/link_layer", "Ethernet")
    _write(root, f"{port}/rate", "200 Gb/sec (2X NDR)")
    _write(root, f"{port}/gid_attrs/ndevs/0", netdev)
    gids = {0: ("fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1"),
            1: ("fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2"),
            2: ("0000:0000:0000:0000:0000:ffff:c0a8:6401", "IB/RoCE v1"),
            3: ("0000:0000:0000:0000:0000:ffff:c0a8:6401", "RoCE v2")}
    for index, (gid, kind) in gids.items():
        _write(root, f"{port}/gids/{index}", gid)
        _write(root, f"{port}/gid_attrs/types/{index}", kind)


def test_dgx_spark_split_port_lists_both_halves_and_gid_3(tmp_path: Path) -> None:
    _netdev(tmp_path, "enp1s0f1np1")
    _netdev(tmp_path, "enP2p1s0f1np1")
    _roce_port(tmp_path, "rocep1s0f1", "enp1s0f1np1")
    _roce_port(tmp_path, "roceP2p1s0f1", "enP2p1s0f1np1")
    facts = nccl_facts.discover(str(tmp_path), ["enp1s0f1np1"], ["rocep1s0f1", "roceP2p1s0f1"], None)
    assert facts["socket_ifname"] == "enp1s0f1np1"
    assert facts["ib_hca"] == "rocep1s0f1:1,roceP2p1s0f1:1"
    assert facts["gid_index"] == 3
    assert facts["env"]["NCCL_IB_HCA"] == "=rocep1s0f1:1,roceP2p1s0f1:1"
    assert facts["env"]["NCCL_IB_GID_INDEX"] == "3"
    assert [h["netdev"] for h in facts["hcas"]] == ["enp1s0f1np1", "enP2p1s0f1np1"]


def test_without_declared_hcas_every_active_port_is_selected(tmp_path: Path) -> None:
    _netdev(tmp_path, "ib0")
    _roce_port(tmp_path, "mlx5_0", "ib0")
    _roce_port(tmp_path, "mlx5_1", "ib1", state="1: DOWN")
    facts = nccl_facts.discover(str(tmp_path), [], [], None)
    assert facts["ib_hca"] == "mlx5_0:1"
    assert facts["socket_ifname"] == "ib0"  # no netdev declared: the up netdev of a selected port


def test_missing_hca_is_reported(tmp_path: Path) -> None:
    _roce_port(tmp_path, "mlx5_0", "ib0")
    facts = nccl_facts.discover(str(tmp_path), [], ["mlx5_0", "mlx5_7"], None)
    assert facts["missing_hcas"] == ["mlx5_7"]


def test_no_rdma_device_gives_sockets_only(tmp_path: Path) -> None:
    _netdev(tmp_path, "eth0")
    facts = nccl_facts.discover(str(tmp_path), ["eth0"], [], None)
    assert facts["hcas"] == [] and facts["ib_hca"] is None and facts["gid_index"] is None
    assert facts["env"] == {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
                            "OMPI_MCA_btl_tcp_if_include": "eth0"}


def test_explicit_gid_index_wins(tmp_path: Path) -> None:
    _roce_port(tmp_path, "mlx5_0", "eth2")
    assert nccl_facts.discover(str(tmp_path), [], [], 5)["gid_index"] == 5
