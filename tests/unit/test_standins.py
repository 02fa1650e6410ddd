"""Stand-in NVIDIA packages: NVIDIA's names and versions, marker files only, valid .debs (dpkg-deb)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from stepdeploy.sim import standins

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed")


def test_the_seed_and_sim_standin_versions() -> None:
    pkgs = {p.name: p.version for p in standins.stack_standins("550.54.15", "12.3", "2.19.3")}
    assert pkgs == {
        "nvidia-driver": "550.54.15-1", "nvidia-kernel-dkms": "550.54.15-1",
        "nvidia-kernel-open-dkms": "550.54.15-1", "nvidia-persistenced": "550.54.15-1",
        "cuda-drivers-550": "550.54.15-1", "cuda-toolkit-12-3": "12.3.2-1",
        "libnccl2": "2.19.3-1+cuda12.3", "libnccl-dev": "2.19.3-1+cuda12.3",
    }


def test_components_a_profile_lacks_have_no_standins() -> None:
    assert standins.stack_standins(None, None, None) == []
    assert {p.name for p in standins.stack_standins(None, "13.0", None)} == {"cuda-toolkit-13-0"}


def test_control_file_says_it_is_a_standin() -> None:
    nccl_dev = next(p for p in standins.nccl_standins("2.19.3", "12.3") if p.name == "libnccl-dev")
    control = standins.control_text(nccl_dev, "amd64")
    assert "Package: libnccl-dev\nVersion: 2.19.3-1+cuda12.3\nArchitecture: amd64\n" in control
    assert "Depends: libnccl2 (= 2.19.3-1+cuda12.3)" in control
    assert standins.MARKER in control


@needs_dpkg
def test_built_debs_carry_name_version_and_marker_files(tmp_path: Path) -> None:
    debs = standins.build_all((("550.54.15", "12.3", "2.19.3"),), dest=tmp_path)
    assert len(debs) == 8
    cuda = tmp_path / standins.cuda_standins("12.3")[0].filename
    fields = subprocess.run(["dpkg-deb", "-f", str(cuda), "Package", "Version"], capture_output=True,
                            text=True, check=True).stdout
    assert fields.splitlines() == ["Package: cuda-toolkit-12-3", "Version: 12.3.2-1"]
    listing = subprocess.run(["dpkg-deb", "-c", str(cuda)], capture_output=True, text=True, check=True).stdout
    nvcc = next(line for line in listing.splitlines() if line.endswith("/usr/local/cuda-12.3/bin/nvcc"))
    assert nvcc.startswith("-rwxr-xr-x root/root")
    # Building again reuses the files.
    assert standins.build_all((("550.54.15", "12.3", "2.19.3"),), dest=tmp_path) == debs


@needs_dpkg
def test_stub_nvcc_reports_the_release(tmp_path: Path) -> None:
    pkg = standins.cuda_standins("12.3")[0]
    script = tmp_path / "nvcc"
    script.write_text(pkg.files["/usr/local/cuda-12.3/bin/nvcc"])
    out = subprocess.run(["sh", str(script), "--version"], capture_output=True, text=True, check=True).stdout
    assert "Cuda compilation tools, release 12.3, V12.3.2" in out


@needs_dpkg
def test_publish_indexes_a_flat_repository(tmp_path: Path) -> None:
    if shutil.which("dpkg-scanpackages") is None:
        pytest.skip("dpkg-scanpackages is not installed")
    debs = standins.build_all((("550.54.15", "12.3", "2.19.3"),), dest=tmp_path / "cache")
    repo = standins.publish(tmp_path / "state", debs)
    index = (repo / "Packages").read_text()
    assert repo == tmp_path / "state" / "repo" / "nvidia"
    assert "Package: libnccl2\nVersion: 2.19.3-1+cuda12.3" in index
    assert (repo / "Packages.gz").exists()
