"""Stack profiles: the shipped data file loads, every version has a source, bad names are BadInput."""

from __future__ import annotations

import pytest

from stepdeploy.errors import BadInput
from stepdeploy.stack import COMPONENTS, get_profile, load_profiles, parse_profiles, profile_names


def test_shipped_profiles() -> None:
    assert profile_names() == ["seed-2024", "hopper-cu128", "hopper-cu130", "spark-cuda13", "sim-cpu",
                                   "sim-standin", "blackwell-cu130"]


def test_gpu_profiles_name_the_cpu_architecture_their_packages_are_built_for() -> None:
    arch = {name: p.arch for name, p in load_profiles().items() if p.cuda and not name.startswith("sim-")}
    assert arch == {"seed-2024": ("x86_64",), "hopper-cu128": ("x86_64",), "hopper-cu130": ("x86_64",),
                    "spark-cuda13": ("aarch64",), "blackwell-cu130": ("x86_64",)}
    assert all(load_profiles()[name].sources["platform"] for name in arch)


def test_every_component_of_every_profile_names_its_source() -> None:
    for profile in load_profiles().values():
        assert set(profile.sources) - {"platform"} == set(COMPONENTS), profile.name
        assert all(source.strip() for source in profile.sources.values())
        assert profile.description


def test_seed_profile_is_the_seed_stack_with_a_real_flash_attn() -> None:
    seed = get_profile("seed-2024")
    assert (seed.driver, seed.cuda, seed.cudnn, seed.python) == ("550.54.15", "12.3", "8.9.7", "3.10")
    assert seed.env_manager == "conda"
    assert seed.nccl == "2.19.3"
    assert seed.torch is not None and seed.torch.startswith("2.3.")
    assert seed.flash_attn is not None and seed.flash_attn.startswith("2.")  # no flash-attn 3.5 exists
    assert "3.5.0" in seed.sources["flash_attn"]  # the note says why the seed's version was replaced
    major, minor = (int(x) for x in (seed.megatron_core or "").split(".")[:2])
    assert (major, minor) < (0, 17)  # >=0.17 needs Python 3.12


def test_spark_profile_has_no_flash_attn_and_cuda_13() -> None:
    spark = get_profile("spark-cuda13")
    assert (spark.cuda, spark.python, spark.flash_attn) == ("13.0", "3.12", None)
    assert spark.driver is not None and spark.driver.startswith("580.")


def test_hopper_profiles_run_megatron_core_0_19_on_python_3_12() -> None:
    for name in ("hopper-cu128", "hopper-cu130"):
        profile = get_profile(name)
        assert (profile.megatron_core, profile.python) == ("0.19.2", "3.12")
    assert get_profile("hopper-cu128").cuda == "12.8"
    assert get_profile("hopper-cu130").driver == "580.159.04"


def test_sim_profile_installs_no_gpu_stack() -> None:
    sim = get_profile("sim-cpu")
    assert (sim.driver, sim.cuda, sim.cudnn, sim.nccl, sim.flash_attn, sim.megatron_core) == (None,) * 6
    assert (sim.python, sim.torch, sim.env_manager) == ("3.11", "2.13.0+cpu", "venv")


def test_unknown_profile_is_bad_input_listing_known_ones() -> None:
    with pytest.raises(BadInput) as caught:
        get_profile("spark-cuda-13")
    assert "did you mean 'spark-cuda13'?" in caught.value.message
    assert "known profiles: seed-2024, hopper-cu128" in caught.value.message


@pytest.mark.parametrize(
    "document",
    [
        None,
        {"profiles": []},
        {"profiles": {"x": "not a mapping"}},
        {"profiles": {"x": {"description": "d", "cuda": {"version": "12.8"}}}},  # no source
        {"profiles": {"x": {"description": "d", "cudaa": {"version": "1", "source": "s"}}}},
        {"profiles": {"x": {"description": "d", "env_manager": {"version": "pipx", "source": "s"}}}},
    ],
)
def test_malformed_profile_data_is_rejected(document: object) -> None:
    with pytest.raises(ValueError):
        parse_profiles(document)
