"""The compatibility matrix: one passing and one failing case per rule, and the suggested profiles."""

from __future__ import annotations

import pytest

from stepdeploy.compat import GpuModel, HostFacts, check, facts_from_nvidia_smi, gpu_arch, verdict
from stepdeploy.stack import StackProfile, get_profile

GB10 = HostFacts("spark-1", "aarch64", (GpuModel("NVIDIA GB10", "12.1"),))
H200 = HostFacts("h200-1", "x86_64", (GpuModel("NVIDIA H200", "9.0"),))
CPU = HostFacts("cpu-1", "x86_64", ())


def _profile(**overrides: str | None) -> StackProfile:
    return get_profile("hopper-cu130").model_copy(update={"name": "custom", **overrides})


def test_gpu_arch_from_compute_capability_or_name() -> None:
    assert gpu_arch(GpuModel("NVIDIA H200", "9.0")) == ("90", "hopper")
    assert gpu_arch(GpuModel("NVIDIA GB10")) == ("121", "blackwell")  # no compute_cap: by name
    assert gpu_arch(GpuModel("Some Future GPU")) is None
    # lspci names, before a driver exists: whole words only (GB10 is not GB100)
    assert gpu_arch(GpuModel('41:00.0 "3D controller" "NVIDIA Corporation" "GB100 [B200]"')) == ("100", "blackwell")
    assert gpu_arch(GpuModel('01:00.0 "3D controller" "NVIDIA Corporation" "GH100 [H200 SXM 141GB]"'))[0] == "90"


def test_seed_profile_refused_on_gb10_with_the_conflicts_and_working_profiles() -> None:
    v = verdict(get_profile("seed-2024"), [GB10])
    assert not v.ok
    components = {c.component for c in v.conflicts}
    # the seed's x86_64 packages (driver .run, conda) on an Arm Spark: refused by architecture too
    assert components == {"CUDA", "PyTorch", "flash-attn", "CPU architecture"}
    cuda = next(c for c in v.conflicts if c.component == "CUDA")
    assert cuda.found == "12.3" and ">= 12.9" in cuda.required and "sm_121" in cuda.required
    assert "spark-cuda13" in v.working_profiles
    assert not any(p.startswith("sim-") for p in v.working_profiles)
    assert "profiles that would work" in v.message()


def test_seed_profile_is_valid_on_hopper() -> None:
    assert verdict(get_profile("seed-2024"), [H200]).ok


@pytest.mark.parametrize("overrides, ok", [
    ({"cuda": "12.3", "driver": "545.23.06"}, True),
    ({"cuda": "12.3", "driver": "535.104.05"}, False),  # below table 3's 545.23.06
    ({"cuda": "13.0", "driver": "575.51.03"}, False),   # 13.x needs >= 580.65.06
    ({"cuda": "12.4", "driver": "530.30.02"}, True),    # not in the table: the 12.x floor (525.60.13)
])
def test_driver_minimum_for_cuda(overrides: dict, ok: bool) -> None:
    conflicts = [c for c in check(_profile(**overrides), CPU) if c.component == "driver"]
    assert (not conflicts) is ok


@pytest.mark.parametrize("cuda, host, ok", [
    ("12.9", GB10, True), ("12.8", GB10, False), ("11.8", H200, True), ("11.7", H200, False),
])
def test_cuda_must_target_the_gpu_architecture(cuda: str, host: HostFacts, ok: bool) -> None:
    conflicts = [c for c in check(_profile(cuda=cuda, driver="590.44.01"), host) if c.component == "CUDA"]
    assert (not conflicts) is ok


@pytest.mark.parametrize("torch, ok", [
    ("2.7.0", False),  # the default PyPI wheel is built for CUDA 12.6: no sm_100/sm_120 kernels
    ("2.7.0+cu128", True),  # the cu128 variant has them
    ("2.7.1+cu126", False),
    ("2.7.0+cpu", False),
    ("2.8.0", True),  # its default wheel is built for CUDA 12.8
    ("2.11.0", True),  # CUDA 13.0
    ("2.6.0+cu126", False),  # older than 2.7
])
def test_blackwell_needs_torch_2_7_built_for_cuda_12_8(torch: str, ok: bool) -> None:
    conflicts = [c for c in check(_profile(torch=torch), GB10) if c.component == "PyTorch"]
    assert (not conflicts) is ok
    if conflicts and torch.startswith("2.7"):
        assert "CUDA >= 12.8" in conflicts[0].required and "pytorch" in conflicts[0].source


def test_torch_cuda_build_from_the_local_tag_or_the_default_wheel() -> None:
    from stepdeploy.compat import torch_cuda_build

    assert torch_cuda_build("2.7.0") == "12.6" and torch_cuda_build("2.7.0+cu128") == "12.8"
    assert torch_cuda_build("2.11.0+cu130") == "13.0" and torch_cuda_build("2.13.0+cpu") == "none"
    assert torch_cuda_build("2.9.1") is None  # not in the table: not judged on its build


@pytest.mark.parametrize("fa, cuda, host, ok", [
    ("2.8.3", "13.0", H200, True),
    ("2.8.3", "13.0", GB10, True),  # FA2 >= 2.7.3 builds sm_120 (GB10 runs it) with CUDA >= 12.8
    ("2.7.3", "12.9", GB10, True),
    ("2.7.2.post1", "13.0", GB10, False),  # before setup.py's Blackwell gencodes
    ("3.5.0", "13.0", H200, False),  # no flash-attn 3.x on PyPI
    ("1.0.9", "13.0", H200, True),  # 1.x exists (existing_majors follows its comment)
    (None, "13.0", GB10, True),
])
def test_flash_attn(fa: str | None, cuda: str, host: HostFacts, ok: bool) -> None:
    conflicts = [c for c in check(_profile(flash_attn=fa, cuda=cuda), host) if c.component == "flash-attn"]
    assert (not conflicts) is ok
    assert all("https://" in c.source for c in conflicts)


def test_flash_attn_on_blackwell_needs_nvcc_12_8() -> None:
    b200 = HostFacts("b200-1", "x86_64", (GpuModel("NVIDIA B200", "10.0"),))
    conflicts = [c for c in check(_profile(flash_attn="2.8.3", cuda="12.6", driver="590.44.01"), b200)
                 if c.component == "flash-attn"]
    assert conflicts and "CUDA >= 12.8" in conflicts[0].required and "setup.py" in conflicts[0].source


@pytest.mark.parametrize("gpu, arch", [
    (GpuModel("NVIDIA A10", "8.6"), ("86", "ampere")),
    (GpuModel("NVIDIA A10"), ("86", "ampere")),  # by name: A10 is not A100
    (GpuModel("NVIDIA A100-SXM4-80GB"), ("80", "ampere")),
    (GpuModel("NVIDIA L40S"), ("89", "ada")),
    (GpuModel("NVIDIA L4"), ("89", "ada")),
    (GpuModel("NVIDIA B300"), ("103", "blackwell")),
])
def test_sm86_sm89_and_b300_by_name_or_capability(gpu: GpuModel, arch: tuple[str, str]) -> None:
    assert gpu_arch(gpu) == arch


@pytest.mark.parametrize("name, cap, cuda, ok", [
    ("NVIDIA A10", "8.6", "11.1", True), ("NVIDIA A10", "8.6", "11.0", False),
    ("NVIDIA L4", "8.9", "11.8", True), ("NVIDIA L4", "8.9", "11.7", False),
    ("NVIDIA B300", "10.3", "12.9", True), ("NVIDIA B300", "10.3", "12.8", False),
])
def test_cuda_minimum_for_sm86_sm89_sm103_with_its_release_notes(name: str, cap: str, cuda: str, ok: bool) -> None:
    host = HostFacts("h", "x86_64", (GpuModel(name, cap),))
    conflicts = [c for c in check(_profile(cuda=cuda, driver="590.44.01"), host) if c.component == "CUDA"]
    assert (not conflicts) is ok
    assert all(c.source.startswith("https://docs.nvidia.com/cuda/") for c in conflicts)


def test_every_matrix_entry_names_a_primary_source() -> None:
    from stepdeploy.compat import matrix

    m = matrix()
    sources = [g["source"] for g in m["gpus"]]
    sources += [e["source"] for key in ("sm_min_cuda", "torch_default_wheel_cuda") for e in m[key]["table"].values()]
    sources += [r["source"] for r in m["torch_min_for_family"]["table"].values()]
    sources += [m["flash_attn"][k] for k in ("fa2_source", "majors_source")]
    sources.append(m["flash_attn"]["fa2_blackwell"]["source"])
    sources.append(m["cuda_min_driver"]["source"])
    assert all("https://" in source for source in sources), [s for s in sources if "https://" not in s]


@pytest.mark.parametrize("mcore, python, ok", [
    ("0.19.2", "3.12", True), ("0.19.2", "3.10", False), ("0.16.1", "3.11", True),
])
def test_megatron_core_python(mcore: str, python: str, ok: bool) -> None:
    profile = _profile(megatron_core=mcore, python=python)
    conflicts = [c for c in check(profile, CPU) if c.component == "Python"]
    assert (not conflicts) is ok


def test_gpu_node_with_a_cpu_profile_is_refused() -> None:
    v = verdict(get_profile("sim-cpu"), [H200])
    assert not v.ok and v.conflicts[0].component == "CUDA"


def test_facts_from_nvidia_smi_csv() -> None:
    facts = facts_from_nvidia_smi("n", "x86_64", "NVIDIA H200, 9.0\nNVIDIA H200, 9.0\n")
    assert facts.gpus == (GpuModel("NVIDIA H200", "9.0"), GpuModel("NVIDIA H200", "9.0"))


def test_sliding_windows_need_a_torch_with_flex_attention() -> None:
    from stepdeploy.compat import model_conflicts

    old = _profile(torch="2.3.1")
    found = model_conflicts(old, sliding_window=True, per_layer=False, where="m")
    assert [(c.component, c.found, c.required) for c in found] == [
        ("PyTorch", "2.3.1", ">= 2.5 for sliding-window attention")]
    assert not model_conflicts(old, sliding_window=False, per_layer=False, where="m")
    assert not model_conflicts(_profile(torch="2.11.0+cu130"), sliding_window=True, per_layer=True, where="m")
    assert model_conflicts(_profile(megatron_core="0.8.0"), sliding_window=False, per_layer=True, where="m")
