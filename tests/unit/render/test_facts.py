"""NCCL facts saved by provisioning -> NodeFacts -> env.sh and the manifest.

The facts files are written the way provisioning writes them: the infiniband role's own module discovers them
from a recorded sysfs layout (a DGX Spark's split RoCE port, an HGX node's InfiniBand HCAs, a node without
RDMA) and the role saves its `nccl` result as JSON.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stepdeploy.cli.app import app
from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Node
from stepdeploy.plan.layout import Layout
from stepdeploy.render import NodeFacts, RenderOptions, node_environment
from stepdeploy.render.facts import default_facts_dir, facts_for, load_facts, parse_facts

from .cases import cpu_nodes, render

MODULE = Path(__file__).resolve().parents[3] / "roles/infiniband/library/stepdeploy_nccl_facts.py"
_spec = importlib.util.spec_from_file_location("stepdeploy_nccl_facts_for_render", MODULE)
assert _spec and _spec.loader
nccl_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nccl_module)

SPARK = Node(name="spark-1", address="192.0.2.1", gpus_per_node=1, gpu_model="GB10", train_iface="enp1s0f1np1",
             fabric="roce", ib_hcas=["rocep1s0f1", "roceP2p1s0f1"])
HGX = Node(name="hgx-0", address="192.0.2.31", gpus_per_node=8, gpu_model="H100", train_iface="ib0",
           fabric="infiniband")


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _port(root: Path, dev: str, netdev: str, link_layer: str, port: int = 1) -> None:
    base = f"class/infiniband/{dev}/ports/{port}"
    _write(root, f"{base}/state", "4: ACTIVE")
    _write(root, f"{base}/phys_state", "5: LinkUp")
    _write(root, f"{base}/link_layer", link_layer)
    _write(root, f"{base}/gid_attrs/ndevs/0", netdev)
    _write(root, f"class/net/{netdev}/operstate", "up")
    _write(root, f"class/net/{netdev}/mtu", "9000")
    if link_layer == "Ethernet":  # RoCE: v1 and v2 GIDs of the link-local and of the IPv4 address
        gids = [("fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1"),
                ("fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2"),
                ("0000:0000:0000:0000:0000:ffff:c0a8:6401", "IB/RoCE v1"),
                ("0000:0000:0000:0000:0000:ffff:c0a8:6401", "RoCE v2")]
        for index, (gid, kind) in enumerate(gids):
            _write(root, f"{base}/gids/{index}", gid)
            _write(root, f"{base}/gid_attrs/types/{index}", kind)


def _saved(facts_dir: Path, node: str, sysfs: Path, netdevs: list[str], hcas: list[str]) -> Path:
    """What the role writes to /etc/stepdeploy/nccl.json and provisioning fetches to <facts dir>/<node>.json."""
    nccl = nccl_module.discover(str(sysfs), netdevs, hcas, None)
    path = facts_dir / f"{node}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nccl, indent=4, sort_keys=True) + "\n")
    return path


def _env(node: Node, facts: NodeFacts | None) -> tuple[dict[str, str], list[str], dict[str, tuple[str, ...]]]:
    variables, notes = node_environment(node, 0, Layout(), RenderOptions(run_id="r"), facts)
    return {v.key: v.value for v in variables}, notes, {v.key: v.why for v in variables}


def test_roce_split_port_facts_give_both_halves_and_the_gid_index(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    _port(sysfs, "rocep1s0f1", "enp1s0f1np1", "Ethernet")
    _port(sysfs, "roceP2p1s0f1", "enP2p1s0f1np1", "Ethernet")
    path = _saved(tmp_path / "facts", SPARK.name, sysfs, ["enp1s0f1np1"], ["rocep1s0f1", "roceP2p1s0f1"])
    facts = load_facts(tmp_path / "facts", [SPARK.name])[SPARK.name]
    assert facts.ib_hcas == ("rocep1s0f1:1", "roceP2p1s0f1:1") and facts.gid_index == 3
    assert facts.source == str(path) and facts.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    env, notes, why = _env(SPARK, facts)
    assert env["NCCL_IB_HCA"] == "=rocep1s0f1:1,roceP2p1s0f1:1"
    assert env["NCCL_IB_GID_INDEX"] == "3" and env["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1"
    assert env["UCX_NET_DEVICES"] == "rocep1s0f1:1,roceP2p1s0f1:1"
    assert str(path) in why["NCCL_IB_GID_INDEX"][0] and str(path) in why["NCCL_IB_HCA"][0]
    assert notes == []


def test_infiniband_facts_list_every_port_of_a_dual_port_hca_and_no_gid(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    _port(sysfs, "mlx5_0", "ib0", "InfiniBand", port=1)
    _port(sysfs, "mlx5_0", "ib1", "InfiniBand", port=2)
    _port(sysfs, "mlx5_1", "ib2", "InfiniBand")
    _saved(tmp_path / "facts", HGX.name, sysfs, ["ib0"], [])
    facts = load_facts(tmp_path / "facts", [HGX.name])[HGX.name]
    env, notes, _ = _env(HGX, facts)
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_0:2,mlx5_1:1"
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and "NCCL_IB_GID_INDEX" not in env
    assert notes == []


def test_no_facts_renders_from_the_inventory_and_says_so() -> None:
    env, notes, why = _env(SPARK, None)
    assert env["NCCL_IB_HCA"] == "=rocep1s0f1,roceP2p1s0f1" and "NCCL_IB_GID_INDEX" not in env
    assert why["NCCL_SOCKET_IFNAME"] == ("training interface of spark-1 (inventory stepdeploy_train_iface)",)
    assert any("GID index not discovered" in n for n in notes)


def test_facts_that_disagree_with_the_inventory_win_and_are_noted() -> None:
    facts = NodeFacts(socket_ifname="enP2p1s0f1np1", ib_hcas=("mlx5_0:1",), gid_index=1, source="f.json")
    env, notes, _ = _env(SPARK, facts)
    assert env["NCCL_SOCKET_IFNAME"] == "enP2p1s0f1np1" and env["NCCL_IB_HCA"] == "=mlx5_0:1"
    assert any("stepdeploy_train_iface=enp1s0f1np1" in n for n in notes)
    assert any("differ from the ports provisioning found" in n for n in notes)


def test_ports_with_different_gid_indexes_leave_it_to_nccl_and_say_why() -> None:
    env, notes, _ = _env(SPARK, NodeFacts(ib_hcas=("a:1", "b:1"), gid_indexes=(1, 3), source="f.json"))
    assert "NCCL_IB_GID_INDEX" not in env
    assert any("different RoCE v2 GID indexes (1, 3)" in n for n in notes)


def test_a_roce_node_whose_facts_found_no_rdma_port_is_noted() -> None:
    _, notes, _ = _env(SPARK, NodeFacts(socket_ifname="enp1s0f1np1", source="f.json"))
    assert any("provisioning found no RDMA port (f.json)" in n for n in notes)


@pytest.mark.parametrize(("content", "says"), [
    (b"{\"socket_ifname\": ", "not a JSON facts file"),
    (b"[1, 2]", "a JSON object was expected"),
    (b"{\"gid_index\": -1}", "gid_index"),
    (b"{\"ib_hca\": \"mlx5_0:1;rm -rf /\"}", "ib_hca"),
    (b"\xff\xfe", "not a JSON facts file"),
    (b"{\"socket_ifname\": \"eth0; reboot\"}", "socket_ifname"),
])
def test_a_malformed_facts_file_is_bad_input_naming_the_file(tmp_path: Path, content: bytes, says: str) -> None:
    (tmp_path / "node1.json").write_bytes(content)
    with pytest.raises(BadInput) as info:
        load_facts(tmp_path, ["node1"])
    assert info.value.message.startswith(f"{tmp_path / 'node1.json'}: ") and says in info.value.message
    assert "\n" not in info.value.message


def test_missing_files_mean_no_facts_for_that_node(tmp_path: Path) -> None:
    (tmp_path / "node1.json").write_text('{"socket_ifname": "eth0"}')
    assert set(load_facts(tmp_path, ["node1", "node2", "a/b"])) == {"node1"}
    assert parse_facts(b'{"socket_ifname": "eth0", "extra": 1}', "x").socket_ifname == "eth0"


def test_facts_directory_default_and_explicit(tmp_path: Path) -> None:
    inventory = tmp_path / "inv.ini"
    assert default_facts_dir(inventory) == tmp_path / ".stepdeploy" / "facts"
    assert facts_for(inventory, ["node1"]) is None, "no default directory: render without facts"
    default_facts_dir(inventory).mkdir(parents=True)
    assert facts_for(inventory, ["node1"]) == {}, "a directory without the node's file: no facts for it"
    with pytest.raises(BadInput, match="does not exist"):
        facts_for(inventory, ["node1"], tmp_path / "nowhere")


def test_manifest_records_the_facts_file_of_each_node_and_notes_the_missing_ones() -> None:
    facts = {"node1": NodeFacts(socket_ifname="eth1", source="/f/node1.json", sha256="ab" * 32)}
    rendered = render(cpu_nodes(), "tiny-dense", Layout(mbs=2),
                      RenderOptions(run_id="facts", iterations=20, seq_length=64, global_batch_size=8), facts=facts)
    manifest = json.loads(rendered.file("manifest.json").text)
    assert manifest["nodes"][0]["facts"] == {"path": "/f/node1.json", "sha256": "ab" * 32}
    assert "facts" not in manifest["nodes"][1]
    assert any(n.startswith("node2: no NCCL facts saved by provisioning") for n in manifest["notes"])
    assert "export NCCL_SOCKET_IFNAME=eth1" in rendered.file("nodes/0-node1/env.sh").text
    assert "export NCCL_SOCKET_IFNAME=eth0" in rendered.file("nodes/1-node2/env.sh").text


SIM_INI = """[sim]
node1 ansible_host=10.83.0.11
node2 ansible_host=10.83.0.12

[sim:vars]
stepdeploy_gpus_per_node=0
stepdeploy_train_iface=eth0
stepdeploy_fabric=ethernet
"""


def _render(tmp_path: Path, out: str, *args: str) -> object:
    inventory = tmp_path / "inv.ini"
    inventory.write_text(SIM_INI)
    return CliRunner().invoke(app, ["render", "-i", str(inventory), "-m", "tiny-dense", "--out",
                                    str(tmp_path / out), "--gbs", "8", "--seq", "64", *args])


def test_render_cli_reads_the_default_facts_directory_next_to_the_inventory(tmp_path: Path) -> None:
    facts_dir = tmp_path / ".stepdeploy" / "facts"
    facts_dir.mkdir(parents=True)
    (facts_dir / "node2.json").write_text('{"socket_ifname": "eth7", "ib_hca": null, "gid_index": null}\n')
    res = _render(tmp_path, "r1")
    assert res.exit_code == 0, res.output
    assert "export NCCL_SOCKET_IFNAME=eth7" in (tmp_path / "r1/nodes/1-node2/env.sh").read_text()
    nodes = json.loads((tmp_path / "r1/manifest.json").read_text())["nodes"]
    assert nodes[1]["facts"]["path"] == str(facts_dir / "node2.json") and "facts" not in nodes[0]


def test_render_cli_facts_dir_option_and_bad_files(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "node1.json").write_text('{"socket_ifname": "eth3"}')
    res = _render(tmp_path, "r2", "--facts-dir", str(other))
    assert res.exit_code == 0, res.output
    assert "export NCCL_SOCKET_IFNAME=eth3" in (tmp_path / "r2/nodes/0-node1/env.sh").read_text()
    (other / "node2.json").write_text("{")
    res = _render(tmp_path, "r3", "--facts-dir", str(other))
    assert isinstance(res.exception, BadInput) and str(other / "node2.json") in res.exception.message
    assert not (tmp_path / "r3").exists()
    res = _render(tmp_path, "r4", "--facts-dir", str(tmp_path / "missing"))
    assert isinstance(res.exception, BadInput) and "does not exist" in res.exception.message
