"""Cross-node checks and the bandwidth gate."""

from __future__ import annotations

from stepdeploy import compat
from stepdeploy.catalog.loader import load_hardware
from stepdeploy.preflight import cluster
from stepdeploy.preflight.model import Status
from stepdeploy.stack import get_profile


def test_versions_must_match_everywhere() -> None:
    same = {"a": {"driver": "580.159.04", "torch": "2.11.0"}, "b": {"driver": "580.159.04", "torch": "2.11.0"}}
    assert cluster.check_same_versions(same).status is Status.OK
    differ = {**same, "b": {"driver": "570.172.08", "torch": "2.11.0"}}
    result = cluster.check_same_versions(differ)
    assert result.status is Status.FAIL
    assert result.observed == "driver: a=580.159.04, b=570.172.08"
    assert cluster.check_same_versions({"a": {}}).status is Status.SKIP


def test_clock_skew_beyond_the_bound_and_its_uncertainty() -> None:
    assert cluster.check_clock({"a": (0.01, 0.002), "b": (-0.2, 0.002)}).status is Status.OK
    result = cluster.check_clock({"a": (0.0, 0.0), "b": (3.5, 0.1)}, bound_s=1.0)
    assert result.status is Status.FAIL and "b" in result.observed
    assert cluster.check_clock({"b": (1.2, 0.3)}, bound_s=1.0).status is Status.OK  # within the uncertainty


def test_reachability_lists_the_broken_pairs() -> None:
    probes = [cluster.Probe("a", "b", "10.0.0.2", True), cluster.Probe("b", "a", "10.0.0.1", False, "refused")]
    result = cluster.check_reachability(probes, 2)
    assert result.status is Status.FAIL and result.observed == "b -> a (10.0.0.1) refused"
    assert cluster.check_reachability([*probes[:1], cluster.Probe("b", "a", "x", True)], 2).status is Status.OK


def test_compat_uses_the_matrix_on_the_gpus_found() -> None:
    h200 = [compat.HostFacts("a", "x86_64", (compat.GpuModel("NVIDIA H200"),))]
    assert cluster.check_compat(get_profile("hopper-cu130"), h200).status is Status.OK
    gb10 = [compat.HostFacts("s", "aarch64", (compat.GpuModel("NVIDIA GB10"),))]
    result = cluster.check_compat(get_profile("seed-2024"), gb10)
    assert result.status is Status.FAIL and "spark-cuda13" in result.fix
    assert cluster.check_compat(None, h200).status is Status.SKIP


def test_gate_comes_from_the_hardware() -> None:
    hw = load_hardware()
    nvlink = cluster.bandwidth_gate(hw, "H200", 1, None)
    assert nvlink.gbps == round(328 * cluster.BUSBW_FRACTION, 2) and "nvlink4" in nvlink.why
    roce = cluster.bandwidth_gate(hw, "GB10", 2, "roce")
    assert roce.gbps == round(23.7 * cluster.BUSBW_FRACTION, 2)
    assert cluster.bandwidth_gate(hw, None, 2, "ethernet").gbps == cluster.GLOO_FLOOR_GBPS


def test_bandwidth_judged_at_the_largest_size() -> None:
    gate = cluster.Gate(262.4, "test")
    rows = [{"size_bytes": 1 << 20, "busbw_gbps": 24.7, "correct": True},
            {"size_bytes": 1 << 30, "busbw_gbps": 326.8, "correct": True, "backend": "nccl", "world": 2}]
    result = cluster.check_bandwidth(rows, gate)
    assert result.status is Status.OK and result.observed.startswith("326.80 GB/s busbw at 1 GiB")
    slow = [{**rows[1], "busbw_gbps": 120.0}]
    assert cluster.check_bandwidth(slow, gate).status is Status.FAIL
    assert cluster.check_bandwidth([{**rows[1], "correct": False}], gate).status is Status.FAIL
    assert cluster.check_bandwidth([], gate).status is Status.FAIL
    assert cluster.check_bandwidth(rows, gate, error="node2: torchrun exited 1").status is Status.FAIL
