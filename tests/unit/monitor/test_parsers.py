"""The parsers read the real H200 recordings; malformed or foreign input is refused, never misread."""

from __future__ import annotations

import pytest

from stepdeploy.monitor import parse_gpu, parse_host, parse_workload

from . import faults

RECORDED_FIELDS = ("index", "name", "uuid", "memory.total", "memory.used", "utilization.gpu", "temperature.gpu",
                   "power.draw", "ecc.errors.uncorrected.volatile.total", "persistence_mode", "pcie.link.gen.current")
BRIEF_FIELDS = ("index", "memory.used", "utilization.gpu", "temperature.gpu", "power.draw",
                "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
                "remapped_rows.pending", "remapped_rows.failure")


@pytest.mark.parametrize("name", ["nvidia-smi-query-gpu-nounits.csv", "nvidia-smi-query-gpu.csv"])
def test_recorded_preflight_csv_with_and_without_units(name):
    gpus = parse_gpu.parse_query_csv((faults.SHARED / name).read_text(), RECORDED_FIELDS)
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].uuid == "GPU-63b6e2bd-9fd5-282c-429c-547572e316c9"
    assert (gpus[0].temperature_c, gpus[0].power_w, gpus[0].memory_used_mib) == (36.0, 79.09, 0.0)
    assert (gpus[1].temperature_c, gpus[1].power_w) == (34.0, 77.28)
    assert gpus[1].ecc_uncorrected_volatile == 0 and gpus[1].ecc_uncorrected_aggregate is None


def test_the_briefs_field_list_as_recorded_on_the_h200():
    gpus = parse_gpu.parse_query_csv((faults.FIXTURES / "query-brief-fields.csv").read_text(), BRIEF_FIELDS)
    assert [(g.index, g.power_w, g.temperature_c) for g in gpus] == [(0, 112.90, 40.0), (1, 125.76, 40.0)]
    assert all(g.ecc_uncorrected_aggregate == 0 and g.remap_pending is False and g.remap_failure is False
               for g in gpus)


def test_monitor_fields_with_header_and_units():
    gpus = parse_gpu.parse_query_csv((faults.FIXTURES / "query-header.csv").read_text())
    assert [g.bus_id for g in gpus] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert gpus[1].power_w == 77.64 and gpus[1].memory_used_mib == 0.0


def test_another_recording_under_our_field_list_is_refused():
    """The stand-in nvidia-smi answers any --query-gpu with the preflight recording: 11 columns, other fields."""
    text = (faults.SHARED / "nvidia-smi-query-gpu-nounits.csv").read_text()
    with pytest.raises(ValueError, match="uuid: unexpected value 'NVIDIA H200'"):
        parse_gpu.parse_query_csv(text)
    with pytest.raises(ValueError, match="5 columns for 11 fields"):
        parse_gpu.parse_query_csv("0, 1, 2, 3, 4")


def test_missing_values_are_none_and_bus_ids_match_xid_lines():
    line = "3, GPU-aa-bb, 00000000:3B:00.0, [N/A], 5, 40, [N/A], [N/A], 0, No, No"
    (gpu,) = parse_gpu.parse_query_csv(line)
    assert gpu.memory_used_mib is None and gpu.power_w is None and gpu.ecc_uncorrected_volatile is None
    (xid,) = parse_gpu.parse_xids("[ 12.5] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', fell off the bus")
    assert (xid.pci, xid.code, xid.time_s) == ("0000:3b:00", 79, 12.5)
    assert parse_gpu.gpu_for_xid(xid, (gpu,)) == 3


def test_xid_lines_without_timestamps_and_other_lines():
    log = "kernel: NVRM: Xid (PCI:0000:07:00): 48, An uncorrectable double bit error\nNVRM: loading module\n"
    (xid,) = parse_gpu.parse_xids(log)
    assert (xid.pci, xid.code, xid.time_s) == ("0000:07:00", 48, None)
    assert parse_gpu.last_stamp("[  1.0] a\n[ 22.25] b\nno stamp") == 22.25


def test_ib_sysfs_lines():
    text = faults.ib_text({"mlx5_0/1": "4: ACTIVE", "mlx5_1/1": "1: DOWN"},
                          {"mlx5_0/1": {"symbol_error": 3, "local_ack_timeout_err": 7}})
    ports = {p.name: p for p in parse_host.parse_ib(text + "\nmlx5_0/ports/1/counters/garbage:n/a")}
    assert ports["mlx5_0/1"].state == "ACTIVE" and ports["mlx5_0/1"].phys_state == "LinkUp"
    assert ports["mlx5_0/1"].counters == {"symbol_error": 3}
    assert ports["mlx5_0/1"].hw_counters == {"local_ack_timeout_err": 7}
    assert ports["mlx5_1/1"].state == "DOWN"


def test_recorded_probe_sample_parses_completely():
    sample = faults.parse(faults.recorded(1))
    assert sample.errors == {}
    assert [(g.index, g.bus_id, g.temperature_c) for g in sample.gpus] == [(0, "00000000:00:06.0", 34.0),
                                                                          (1, "00000000:00:07.0", 33.0)]
    assert sample.xids == () and sample.kernel_mark_s is not None and sample.ib_ports == ()
    eth0 = next(d for d in sample.netdevs if d.name == "eth0")
    assert eth0.operstate == "up" and eth0.stats["rx_errors"] == 0
    assert sample.meminfo_kib["MemTotal"] == 263998500
    assert sample.disk is not None and sample.disk.path == "/tmp" and sample.disk.total_bytes == 264212084 * 1024
    assert sample.heartbeats == () and sample.ranks == () and sample.metrics == ()
    assert sample.time > 1.7e9  # the node's clock


def test_workload_files():
    beats = parse_workload.parse_heartbeats(faults.heartbeats({1: (7, 10.5), 0: (8, 11.0)}) + "\nrank2 {trunc")
    assert [(b.rank, b.iteration, b.time, b.pid) for b in beats] == [(0, 8, 11.0, 1000), (1, 7, 10.5, 1001)]
    ranks = parse_workload.parse_statuses(faults.statuses({0: "running", 1: "exited"}))
    assert [(r.rank, r.state, r.node) for r in ranks] == [(0, "running", "h200"), (1, "exited", "h200")]
    rows = parse_workload.parse_metrics(faults.metrics([(1, float("nan"), float("inf"), [0.5, 0.6])]) + '\n{"it')
    assert len(rows) == 1 and rows[0].iteration == 1 and rows[0].rank_step_time_s == (0.5, 0.6)
    assert not parse_workload.is_finite(rows[0].loss) and not parse_workload.is_finite(rows[0].grad_norm)
