"""Pure parts of the simulated cluster: naming, addressing, the base recipe's cache key, the inventory
it writes (parsed back by the same inventory loader users run)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from stepdeploy.errors import BadInput
from stepdeploy.inventory import load_cluster
from stepdeploy.sim import base
from stepdeploy.sim.cluster import MAX_NODES, SimConfig, render_inventory
from stepdeploy.sim.state import SimState


def test_addresses_and_interface_names_fit_linux_limits() -> None:
    cfg = SimConfig(name="abcdefgh", subnet="10.77.0.0/24")
    last = cfg.new_node(MAX_NODES)
    assert cfg.bridge_address() == "10.77.0.1"
    assert cfg.new_node(1).address == "10.77.0.11"
    assert last.address == f"10.77.0.{10 + MAX_NODES}"
    assert len(last.veth) <= 15 and len(f"sd-{cfg.name}") <= 15  # IFNAMSIZ - 1


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "UPPER"}, "cluster name"),
    ({"name": "waytoolongname"}, "cluster name"),
    ({"name": "a;rm"}, "cluster name"),
    ({"subnet": "not-a-net"}, "not an IPv4 network"),
    ({"subnet": "8.8.8.0/24"}, "private"),
    ({"subnet": "10.0.0.0/28"}, "/24 or larger"),
])
def test_bad_config_is_bad_input(kwargs: dict, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        SimConfig(**kwargs)


def test_base_cache_key_follows_the_recipe() -> None:
    recipe = base.BaseRecipe()
    assert base.base_dir(recipe) == base.base_dir(base.BaseRecipe())
    for change in ({"packages": (*recipe.packages, "curl")}, {"node_wheels": ("torch==2.12.0",)},
                   {"suite": "trixie"}, {"steps_version": recipe.steps_version + 1}):
        assert base.base_dir(dataclasses.replace(recipe, **change)) != base.base_dir(recipe), change


def test_written_inventory_parses_into_the_cluster_model(tmp_path: Path) -> None:
    cfg = SimConfig(name="unit", subnet="10.90.0.0/24", state_dir=tmp_path / "unit")
    sim = SimState(name="unit", subnet=cfg.subnet, bridge="sd-unit", bridge_address=cfg.bridge_address(),
                   http_port=8080, base="/nonexistent", nodes=[cfg.new_node(i) for i in (1, 2, 3)])
    cfg.dir.mkdir()
    cfg.inventory.write_text(render_inventory(cfg, sim))
    cluster = load_cluster(cfg.inventory)
    assert [(n.name, n.address) for n in cluster.nodes] == [
        ("node1", "10.90.0.11"), ("node2", "10.90.0.12"), ("node3", "10.90.0.13")]
    node = cluster.nodes[0]
    assert node.ssh.user == "root" and node.ssh.port == 22
    assert node.ssh.private_key_file == cfg.client_key
    assert node.ssh.known_hosts_file == cfg.known_hosts
    assert node.gpus_per_node == 0 and node.fabric == "ethernet" and node.train_iface == "eth0"
    assert cluster.profile is not None and cluster.profile.name == "sim-cpu"


def test_a_zombie_is_not_a_live_process() -> None:
    """sim down must not wait for an exited node process that nobody has reaped yet (it runs nothing)."""
    import os
    import subprocess
    import time

    from stepdeploy.sim.state import is_ours, process_start_time

    child = subprocess.Popen(["sleep", "0.5"])
    start = process_start_time(child.pid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and process_start_time(child.pid) is not None:
        time.sleep(0.01)  # once sleep exits, unreaped, it stays a zombie
    assert start is not None and process_start_time(child.pid) is None and not is_ours(child.pid, start)
    assert os.path.exists(f"/proc/{child.pid}")  # still there as a zombie until we reap it
    child.wait()
    assert process_start_time(os.getpid()) is not None
