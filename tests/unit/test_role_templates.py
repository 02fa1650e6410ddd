"""The roles' templates, rendered with the roles' default values (StrictUndefined), pinned as text.

Ansible renders them on the controller with the same Jinja; the two Ansible filters they use (`basename`,
`bool`) are provided here. If a template changes on purpose, update the expected text below.
"""

from __future__ import annotations

import os
from pathlib import Path

import jinja2
import pytest
import yaml

ROLES = Path(__file__).resolve().parents[2] / "roles"


def render(role: str, template: str, **overrides: object) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROLES / role / "templates"),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, keep_trailing_newline=True)
    env.filters["basename"] = os.path.basename
    env.filters["bool"] = lambda v: v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
    values = yaml.safe_load((ROLES / role / "defaults/main.yml").read_text())
    return env.get_template(template).render({**values, **overrides})


def test_limits_lists_root_explicitly() -> None:
    assert render("common", "limits.conf.j2").splitlines()[2:] == [
        "* soft memlock unlimited", "* hard memlock unlimited", "* soft nofile 1048576", "* hard nofile 1048576",
        "root soft memlock unlimited", "root hard memlock unlimited", "root soft nofile 1048576",
        "root hard nofile 1048576",
    ]


def test_chrony_servers_and_pools() -> None:
    text = render("common", "chrony.conf.j2", common_chrony_servers=["10.0.0.1"])
    assert text.splitlines()[1:4] == ["server 10.0.0.1 iburst", "pool pool.ntp.org iburst",
                                      "driftfile /var/lib/chrony/chrony.drift"]
    assert "makestep 1.0 3\n" in text


def test_network_sysctls_sorted() -> None:
    assert render("infiniband", "sysctl.conf.j2").splitlines()[1:] == [
        "net.ipv4.conf.all.arp_announce = 2", "net.ipv4.conf.all.arp_ignore = 1", "net.ipv4.tcp_mtu_probing = 1"]


def test_mtu_udev_rule() -> None:
    text = render("infiniband", "mtu.rules.j2", infiniband_netdevs=["enp1s0f1np1"])
    assert text.splitlines()[1] == ('ACTION=="add", SUBSYSTEM=="net", KERNEL=="enp1s0f1np1", '
                                    'RUN+="/usr/sbin/ip link set dev $name mtu 9000"')


@pytest.mark.parametrize(("trusted", "last"), [(True, "Trusted: yes"),
                                               (False, "Signed-By: /etc/apt/keyrings/nvidia-cuda.asc")])
def test_nvidia_repository_source(trusted: bool, last: str) -> None:
    text = render("nvidia_repo", "repository.sources.j2", nvidia_repo_url="http://10.0.0.1:8080/nvidia",
                  nvidia_repo_suite="./", nvidia_repo_trusted=trusted,
                  __nvidia_repo_keyring="/etc/apt/keyrings/nvidia-cuda.asc")
    assert text.splitlines()[1:] == ["Types: deb", "URIs: http://10.0.0.1:8080/nvidia", "Suites: ./", last]


def test_version_pins() -> None:
    assert render("cuda_toolkit", "preferences.j2", cuda_toolkit_version="12.3",
                  __cuda_toolkit_package="cuda-toolkit-12-3").splitlines()[1:] == [
        "Package: cuda-toolkit-12-3", "Pin: version 12.3.*", "Pin-Priority: 1001"]
    assert render("nccl", "preferences.j2", __nccl_package_version="2.19.3-1+cuda12.3").splitlines()[1:] == [
        "Package: libnccl2 libnccl-dev", "Pin: version 2.19.3-1+cuda12.3", "Pin-Priority: 1001"]
    assert render("nvidia_driver", "preferences.j2", nvidia_driver_version="550.54.15",
                  __nvidia_driver_packages=["nvidia-driver", "nvidia-kernel-dkms"],
                  __nvidia_driver_package_version="550.54.15-*").splitlines()[1:] == [
        "Package: nvidia-driver nvidia-kernel-dkms", "Pin: version 550.54.15-*", "Pin-Priority: 1001"]


def test_conda_environment_file() -> None:
    text = render("python_env", "environment.yml.j2", python_env_python_version="3.10",
                  python_env_packages=["torch==2.3.1", "megatron-core==0.8.0"],
                  __python_env_pip_arg_list=["--no-index", "--find-links /mirror/wheels"])
    assert yaml.safe_load(text) == {
        "name": "env", "channels": ["conda-forge"],
        "dependencies": ["python=3.10", "pip", {"pip": ["--no-index", "--find-links /mirror/wheels",
                                                        "torch==2.3.1", "megatron-core==0.8.0"]}],
    }
