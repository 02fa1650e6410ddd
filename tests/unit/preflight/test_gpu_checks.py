"""GPU checks against the outputs recorded on the H200 x2 machine, and variants with injected faults."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepdeploy.preflight import gpu
from stepdeploy.preflight.model import Section, Status

FIXTURES = Path(__file__).parents[2] / "fixtures" / "h200-x2"
XML = (FIXTURES / "nvidia-smi-q.xml").read_text()
TOPO = (FIXTURES / "nvidia-smi-topo-m.txt").read_text()


def inv(xml: str = XML) -> gpu.GpuInventory:
    result = gpu.inventory(Section(0, xml))
    assert isinstance(result, gpu.GpuInventory)
    return result


def test_recorded_h200_pair_parses() -> None:
    found = inv()
    assert (found.driver, found.cuda) == ("580.159.04", "13.0")
    assert [(g.index, g.name, g.memory_mib, g.persistence) for g in found.gpus] == [
        (0, "NVIDIA H200", 143771, "Enabled"), (1, "NVIDIA H200", 143771, "Enabled")]
    assert all(g.uncorrectable_aggregate == 0 and not g.remap_pending for g in found.gpus)


def test_healthy_recording_passes_every_gpu_check() -> None:
    found = inv()
    assert gpu.check_gpus(found, 2, "H200", 143771).status is Status.OK
    assert gpu.check_driver(found, "580.159.04").status is Status.OK
    assert gpu.check_cuda(found, "13.0").status is Status.OK
    assert gpu.check_persistence(found).status is Status.OK
    assert gpu.check_ecc(found).status is Status.OK
    assert gpu.check_remap(found).status is Status.OK
    topo = gpu.check_topology(Section(0, TOPO), found, nvlink_expected=True)
    assert topo.status is Status.OK and "NV18" in topo.observed


def test_uncorrectable_ecc_fails_with_a_drain_fix() -> None:
    bad = XML.replace("<dram_uncorrectable>0</dram_uncorrectable>", "<dram_uncorrectable>3</dram_uncorrectable>", 1)
    result = gpu.check_ecc(inv(bad))
    assert result.status is Status.FAIL
    assert "GPU 0 (00000000:00:06.0): 3 volatile" in result.observed
    assert "drain" in result.fix


@pytest.mark.parametrize("tag", ["remapped_row_pending", "remapped_row_failure"])
def test_row_remap_pending_or_failed_fails(tag: str) -> None:
    bad = XML.replace(f"<{tag}>No</{tag}>", f"<{tag}>Yes</{tag}>", 1)
    assert gpu.check_remap(inv(bad)).status is Status.FAIL


def test_a_missing_gpu_fails_the_count() -> None:
    one = XML[:XML.index('<gpu id="00000000:00:07.0">')] + "</nvidia_smi_log>\n"
    result = gpu.check_gpus(inv(one), 2, "H200")
    assert result.status is Status.FAIL
    assert result.observed.startswith("1x NVIDIA H200")


def test_wrong_model_and_less_memory() -> None:
    assert gpu.check_gpus(inv(), 2, "H100").status is Status.FAIL
    assert gpu.check_gpus(inv(), 2, "H200", catalog_memory_mib=200000).status is Status.WARN


def test_driver_other_than_the_profile_warns_and_too_old_cuda_fails() -> None:
    assert gpu.check_driver(inv(), "570.172.08").status is Status.WARN
    old = XML.replace("<cuda_version>13.0</cuda_version>", "<cuda_version>12.4</cuda_version>")
    assert gpu.check_cuda(inv(old), "12.8").status is Status.FAIL
    assert gpu.check_cuda(inv(old), "12.3").status is Status.OK


def test_persistence_off_warns() -> None:
    off = XML.replace("<persistence_mode>Enabled</persistence_mode>",
                      "<persistence_mode>Disabled</persistence_mode>", 1)
    result = gpu.check_persistence(inv(off))
    assert result.status is Status.WARN and "GPU 0" in result.observed


def test_no_driver_skips_on_cpu_nodes_and_fails_where_gpus_are_declared() -> None:
    missing = gpu.inventory(Section(127, "sh: 1: nvidia-smi: not found"))
    assert missing is None
    assert gpu.check_gpus(missing, 0, None).status is Status.SKIP
    assert gpu.check_gpus(missing, 8, "H100").status is Status.FAIL
    broken = gpu.inventory(Section(9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"))
    assert isinstance(broken, str)
    assert gpu.check_gpus(broken, 8, None).status is Status.FAIL


LOG = """[  12.1] NVRM: Xid (PCI:0000:00:06): 13, pid=4242, name=python, Graphics Exception
[  99.0] NVRM: Xid (PCI:0000:00:07): 79, pid=0, GPU has fallen off the bus.
"""


def test_xid_lists() -> None:
    assert gpu.parse_xids(LOG) == [("PCI:0000:00:06", 13), ("PCI:0000:00:07", 79)]
    assert gpu.check_xid(Section(0, LOG), True).status is Status.FAIL
    app_only = LOG.splitlines()[0]
    assert gpu.check_xid(Section(0, app_only), True).status is Status.WARN
    assert gpu.check_xid(Section(0, ""), True).status is Status.OK
    assert gpu.check_xid(Section(3, "cannot read the kernel log (dmesg)"), True).status is Status.WARN


def test_topology_over_pcie_warns_when_nvlink_is_expected() -> None:
    pcie = TOPO.replace("NV18", "SYS")
    assert gpu.parse_topology(pcie)[(0, 1)] == "SYS"
    assert gpu.check_topology(Section(0, pcie), inv(), nvlink_expected=True).status is Status.WARN
