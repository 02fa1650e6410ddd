"""Good inventories load into the right Cluster: INI and YAML, group_vars/host_vars, the shipped ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepdeploy.inventory import Cluster, load_cluster

REPO = Path(__file__).resolve().parents[2]

# What `stepdeploy sim up` writes (stepdeploy/sim/cluster.py render_inventory).
SIM_INVENTORY = """\
[sim]
node1 ansible_host=10.77.0.11
node2 ansible_host=10.77.0.12
[sim:vars]
ansible_user=root
ansible_port=22
ansible_ssh_private_key_file=/var/lib/stepdeploy/sim/sim/id_ed25519
ansible_ssh_common_args='-o UserKnownHostsFile=/var/lib/stepdeploy/sim/sim/known_hosts \
-o StrictHostKeyChecking=yes'
ansible_python_interpreter=/usr/bin/python3
stepdeploy_ssh_known_hosts=/var/lib/stepdeploy/sim/sim/known_hosts
stepdeploy_gpus_per_node=0
stepdeploy_profile=sim-cpu
stepdeploy_train_iface=eth0
stepdeploy_fabric=ethernet
"""


def write(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_sim_inventory_loads_with_every_value(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, "inventory.ini", SIM_INVENTORY))

    assert [n.name for n in cluster.nodes] == ["node1", "node2"]
    assert [n.address for n in cluster.nodes] == ["10.77.0.11", "10.77.0.12"]
    node = cluster.node("node2")
    assert node.groups == ["sim"]
    assert node.ssh.user == "root"
    assert node.ssh.port == 22
    assert node.ssh.connection == "ssh"
    assert node.ssh.private_key_file == Path("/var/lib/stepdeploy/sim/sim/id_ed25519")
    assert node.ssh.known_hosts_file == Path("/var/lib/stepdeploy/sim/sim/known_hosts")
    assert node.gpus_per_node == 0
    assert node.train_iface == "eth0"
    assert node.fabric == "ethernet"
    assert node.ib_hcas == []
    assert node.gpu_model is None and node.arch is None
    assert cluster.profile is not None and cluster.profile.name == "sim-cpu"
    assert cluster.profile.torch == "2.13.0+cpu"
    assert cluster.warnings == []


def test_yaml_inventory_with_children_and_host_vars(tmp_path: Path) -> None:
    path = write(tmp_path, "hosts.yml", """\
all:
  vars:
    stepdeploy_profile: hopper-cu130
  children:
    gpu:
      hosts:
        a.example.org: {ansible_port: 2222, stepdeploy_arch: arm64}
        b:
          ansible_host: 2001:db8::2
          ansible_user: ops
      vars:
        stepdeploy_gpus_per_node: "8"
        stepdeploy_fabric: IB
        stepdeploy_ib_hcas: "mlx5_0, mlx5_1:1"
""")
    cluster = load_cluster(path)

    a, b = cluster.node("a.example.org"), cluster.node("b")
    assert (a.address, a.ssh.port, a.arch) == ("a.example.org", 2222, "aarch64")
    assert (b.address, b.ssh.port, b.ssh.user) == ("2001:db8::2", 22, "ops")
    assert a.gpus_per_node == b.gpus_per_node == 8
    assert a.fabric == "infiniband"
    assert b.ib_hcas == ["mlx5_0", "mlx5_1:1"]
    assert cluster.profile is not None and cluster.profile.cuda == "13.0"


def test_group_vars_and_host_vars_resolve_with_ansible_precedence(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "[gpu]\nn1 ansible_host=192.0.2.1\nn2 ansible_host=192.0.2.2\n"
                                      "[gpu:vars]\nstepdeploy_gpus_per_node=2\nstepdeploy_gpu_model=A100\n")
    write(tmp_path, "group_vars/all.yml", "stepdeploy_profile: seed-2024\nstepdeploy_fabric: roce\n")
    write(tmp_path, "group_vars/gpu.yml", "stepdeploy_gpus_per_node: 4\n")
    write(tmp_path, "host_vars/n2.yml", "stepdeploy_gpus_per_node: 8\nstepdeploy_train_iface: enp1s0f1np1\n")

    cluster = load_cluster(path)

    n1, n2 = cluster.nodes
    assert n1.gpus_per_node == 4  # group_vars/gpu.yml beats [gpu:vars] in the inventory file
    assert n2.gpus_per_node == 8  # host_vars beat group_vars
    assert n1.gpu_model == n2.gpu_model == "A100"
    assert n1.fabric == "roce" and n1.train_iface is None
    assert n2.train_iface == "enp1s0f1np1"
    assert cluster.profile is not None and cluster.profile.name == "seed-2024"


def test_older_ansible_aliases_and_known_hosts_from_ssh_args(tmp_path: Path) -> None:
    path = write(tmp_path, "inv", "n1 ansible_ssh_host=192.0.2.7 ansible_ssh_user=admin "
                                  "ansible_ssh_port=2200 ansible_private_key_file=/k/id "
                                  "ansible_ssh_extra_args='-oUserKnownHostsFile=/k/known_hosts'\n")
    node = load_cluster(path).node("n1")

    assert (node.address, node.ssh.user, node.ssh.port) == ("192.0.2.7", "admin", 2200)
    assert node.ssh.private_key_file == Path("/k/id")
    assert node.ssh.known_hosts_file == Path("/k/known_hosts")
    assert node.groups == []


def test_stepdeploy_known_hosts_wins_over_ssh_args(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "n1 ansible_host=192.0.2.7 stepdeploy_ssh_known_hosts=~/kh "
                                      "ansible_ssh_common_args='-o UserKnownHostsFile=/other'\n")
    assert load_cluster(path).node("n1").ssh.known_hosts_file == Path("~/kh").expanduser()


def test_address_from_the_inventory_name_or_local_connection(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "192.0.2.40\nnode.example.com ansible_port=2022\n"
                                      "controller ansible_connection=local\n")
    cluster = load_cluster(path)

    assert cluster.node("192.0.2.40").address == "192.0.2.40"
    assert cluster.node("node.example.com").address == "node.example.com"
    local = cluster.node("controller")
    assert (local.address, local.ssh.connection) == ("controller", "local")
    assert cluster.profile is None


def test_same_address_on_different_ports_is_two_nodes(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "a ansible_host=192.0.2.9 ansible_port=2201\n"
                                      "b ansible_host=192.0.2.9 ansible_port=2202\n")
    assert [n.ssh.port for n in load_cluster(path).nodes] == [2201, 2202]


def test_group_name_ansible_only_warns_about_is_kept_as_a_warning(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, "inv.ini", "[gpu-nodes]\nn1 ansible_host=192.0.2.1\n"))

    assert cluster.node("n1").groups == ["gpu-nodes"]
    assert len(cluster.warnings) == 1 and "Invalid characters" in cluster.warnings[0]


def test_loading_prints_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    load_cluster(write(tmp_path, "inv.ini", "[gpu-nodes]\nn1 ansible_host=192.0.2.1\n"))
    captured = capfd.readouterr()
    assert (captured.out, captured.err) == ("", "")


def test_cluster_round_trips_through_json(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, "inventory.ini", SIM_INVENTORY))
    assert Cluster.model_validate_json(cluster.model_dump_json()) == cluster


# --- the inventories shipped in inventory/ ----------------------------------------------------------------


def test_shipped_dgx_inventory_is_the_seed_pair_on_hopper() -> None:
    cluster = load_cluster(REPO / "inventory" / "dgx.ini")

    assert [n.name for n in cluster.nodes] == ["dgx-01", "dgx-02"]
    assert all(n.address.startswith("192.0.2.") for n in cluster.nodes)  # documentation range only
    for node in cluster.nodes:
        assert (node.gpus_per_node, node.gpu_model, node.arch) == (8, "H100", "x86_64")
        assert node.fabric == "infiniband"
        assert node.ib_hcas == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    profile = cluster.profile
    assert profile is not None and profile.name == "seed-2024"
    assert (profile.driver, profile.cuda, profile.cudnn) == ("550.54.15", "12.3", "8.9.7")
    assert (profile.python, profile.env_manager) == ("3.10", "conda")
    assert profile.torch is not None and profile.torch.startswith("2.3.")


def test_shipped_spark_pair_example() -> None:
    cluster = load_cluster(REPO / "inventory" / "examples" / "dgx-spark-pair.yml")

    assert len(cluster.nodes) == 2
    for node in cluster.nodes:
        assert (node.gpus_per_node, node.gpu_model, node.arch) == (1, "GB10", "aarch64")
        assert node.fabric == "roce"
        assert node.ib_hcas == ["rocep1s0f1", "roceP2p1s0f1"]
        assert node.train_iface == "enp1s0f1np1"
    assert cluster.profile is not None
    profile = cluster.profile
    assert (profile.name, profile.cuda, profile.flash_attn) == ("spark-cuda13", "13.0", None)


def test_shipped_hgx_pair_example() -> None:
    cluster = load_cluster(REPO / "inventory" / "examples" / "hgx-h100-pair.ini")

    assert [n.address for n in cluster.nodes] == ["192.0.2.31", "192.0.2.32"]
    for node in cluster.nodes:
        assert (node.gpus_per_node, node.gpu_model, node.fabric) == (8, "H100", "infiniband")
        assert node.ib_hcas == [f"mlx5_{i}" for i in range(8)]
    assert cluster.profile is not None and cluster.profile.name == "hopper-cu128"
