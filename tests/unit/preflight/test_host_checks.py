"""Host checks over probe sections (recorded or typical outputs)."""

from __future__ import annotations

import json

import pytest

from stepdeploy.preflight import host
from stepdeploy.preflight.model import Section, Status
from stepdeploy.stack import get_profile

CUDA_ENV = {"python": "3.12.3", "executable": "/opt/torch/.venv/bin/python3", "torch": "2.11.0+cu130",
            "torch_cuda": "13.0", "cuda_available": True, "cuda_devices": 2, "torch_nccl": "2.28.9",
            "megatron_core": "0.19.2", "megatron_core_error": None, "flash_attn": None}


def py(env: dict, noise: str = "") -> Section:
    return Section(0, noise + json.dumps(env))


def test_os_and_arch_from_the_recorded_uname() -> None:
    uname = Section(0, "Linux 6.18.44-fc-v657-gpu x86_64")
    release = Section(0, 'PRETTY_NAME="Ubuntu 24.04.3 LTS"\nID=ubuntu')
    assert host.check_os(uname, release).observed == "Ubuntu 24.04.3 LTS, kernel 6.18.44-fc-v657-gpu"
    assert host.check_arch(uname, "x86_64").status is Status.OK
    assert host.check_arch(uname, "aarch64").status is Status.FAIL


def test_python_stack_against_the_hopper_cu130_profile() -> None:
    exp = host.Expect(gpus=2, profile=get_profile("hopper-cu130"))
    section = py(CUDA_ENV, noise="UserWarning: Transformer Engine is not installed\n")
    assert host.check_python(section, exp).status is Status.OK
    assert host.check_torch(section, exp).status is Status.OK
    assert host.check_megatron(section, exp).status is Status.OK
    assert host.check_flash_attn(section, exp).status is Status.SKIP


def test_cpu_torch_on_a_gpu_node_fails_and_a_missing_profile_package_fails() -> None:
    exp = host.Expect(gpus=8, profile=get_profile("hopper-cu128"))
    cpu = {**CUDA_ENV, "torch": "2.13.0+cpu", "torch_cuda": None, "cuda_available": False}
    assert host.check_torch(py(cpu), exp).status is Status.FAIL
    assert host.check_flash_attn(py(CUDA_ENV), exp).status is Status.FAIL  # profile wants 2.8.3
    broken = {**CUDA_ENV, "megatron_core_error": "ImportError: libcudart.so.12"}
    assert host.check_megatron(py(broken), exp).status is Status.FAIL


def test_no_python_output_fails_the_python_check() -> None:
    assert host.check_python(Section(127, "no python found"), host.Expect()).status is Status.FAIL
    assert host.check_torch(Section(0, "{}"), host.Expect()).status is Status.FAIL


def test_nccl_from_the_package_and_torch() -> None:
    pkg = Section(0, "libnccl2 2.28.3-1+cuda13.0\nlibnccl-dev 2.28.3-1+cuda13.0")
    assert host.nccl_versions(pkg, py(CUDA_ENV)) == ("2.28.3-1+cuda13.0", "2.28.9")
    result = host.check_nccl(pkg, py(CUDA_ENV), host.Expect(gpus=2))
    assert result.status is Status.OK and result.observed == "libnccl2 2.28.3-1+cuda13.0, torch's 2.28.9"
    none = {**CUDA_ENV, "torch_nccl": None}
    assert host.check_nccl(Section(0, ""), py(none), host.Expect(gpus=2)).status is Status.FAIL
    assert host.check_nccl(Section(0, ""), py(none), host.Expect(gpus=0)).status is Status.SKIP


def test_limits_shm_and_disk() -> None:
    assert host.check_memlock(Section(0, "unlimited"), "roce").status is Status.OK
    assert host.check_memlock(Section(0, "8192"), "roce").status is Status.FAIL
    assert host.check_memlock(Section(0, "8192"), "ethernet").status is Status.WARN
    df_small = "Filesystem 1024-blocks Used Available Capacity Mounted on\nshm 65536 0 65536 0% /dev/shm"
    assert host.check_shm(Section(0, df_small), 1.0).status is Status.FAIL
    df_root = "/var/ckpt\nFilesystem 1024-blocks Used Available Capacity Mounted on\n/dev/vda 100 0 20971520 0% /"
    result = host.check_disk(Section(0, df_root), 50, "/var/ckpt/run1")
    assert result.status is Status.FAIL and result.observed.startswith("20.0 GiB free at /var/ckpt")
    assert host.check_disk(Section(0, df_root), 10, "/var/ckpt").status is Status.OK


IB = ("mlx5_0|1|4: ACTIVE|400 Gb/sec (4X NDR)|InfiniBand|ib0|4092|-\n"
      "mlx5_1|1|1: DOWN|10 Gb/sec (4X SDR)|InfiniBand|ib1|4092|-\n")
ROCE = ("rocep1s0f1|1|4: ACTIVE|200 Gb/sec (4X HDR)|Ethernet|enp1s0f1np1|1500|"
        "0000:0000:0000:0000:0000:ffff:c0a8:6401\n")


def test_rdma_ports() -> None:
    ib = host.Expect(fabric="infiniband", ib_hcas=("mlx5_0", "mlx5_1"))
    result = host.check_ib(Section(0, IB), ib)
    assert result.status is Status.FAIL and "mlx5_1/1 DOWN" in result.observed
    assert host.check_ib(Section(0, IB), host.Expect(fabric="infiniband", ib_hcas=("mlx5_0",))).status is Status.OK
    roce = host.check_ib(Section(0, ROCE), host.Expect(fabric="roce", ib_hcas=("rocep1s0f1",)))
    assert roce.status is Status.FAIL and "MTU 1500" in roce.observed
    assert host.check_ib(Section(0, ""), host.Expect(fabric="ethernet")).status is Status.SKIP


def test_peermem_and_training_interface() -> None:
    exp = host.Expect(gpus=8, fabric="infiniband", train_iface="ib0")
    assert host.check_peermem(Section(0, "nvidia_peermem 16384 0 - Live\n"), exp).status is Status.OK
    assert host.check_peermem(Section(0, "nvidia 100 0 - Live\n"), exp).status is Status.WARN
    iface = Section(0, "1500\n4: ib0    inet 10.0.0.5/24 brd 10.0.0.255 scope global ib0")
    assert host.iface_facts(iface) == (1500, "10.0.0.5")
    assert host.check_iface(iface, exp).status is Status.WARN
    assert host.check_iface(Section(1, "cat: /sys/class/net/ib0/mtu: No such file"), exp).status is Status.FAIL


def test_the_disk_check_is_sized_for_the_checkpoints_a_run_keeps() -> None:
    """--model and --keep-checkpoints: room for K committed checkpoints plus the one being written."""
    from types import SimpleNamespace

    from stepdeploy.cli.preflight import checkpoint_space
    from stepdeploy.plan import checkpoint

    gpu_node = SimpleNamespace(gpus_per_node=8)
    assert checkpoint_space(None, [gpu_node], 2, 50.0) == (50.0, None)
    per_node = checkpoint.checkpoint_bytes_per_node(197_800_415_232, 8, 2) / 1024**3  # Step-3.5-Flash, 2 nodes
    need, why = checkpoint_space("step-3.5-flash", [gpu_node, gpu_node], 2, 50.0)
    assert need == pytest.approx(3 * per_node, rel=0.01) and need > 1000
    assert why.startswith("2 kept + 1 in flight checkpoints of step-3.5-flash")
    need1, _ = checkpoint_space("step-3.5-flash", [gpu_node, gpu_node], 1, 50.0)
    assert need1 == pytest.approx(need * 2 / 3)
    tiny, why = checkpoint_space("tiny-dense", [SimpleNamespace(gpus_per_node=None)], 2, 50.0)
    assert tiny == 50.0 and "--min-free-gib 50 is more" in why  # the floor stays
    df = "/var/ckpt\nFilesystem 1024-blocks Used Available Capacity Mounted on\n/dev/vda 100 0 1073741824 0% /"
    result = host.check_disk(Section(0, df), need, "/var/ckpt", why)
    assert result.status is Status.FAIL and "2 kept + 1 in flight" in result.expected
    assert "--keep-checkpoints" in result.fix
