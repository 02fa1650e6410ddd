"""Injected faults (variants of the real H200 samples) are caught with the right severity on the right
GPU/port/interface; a steady pair of samples raises nothing (the false-alarm test)."""

from __future__ import annotations

from stepdeploy.monitor.judge import judge_node
from stepdeploy.monitor.model import MonitorLimits, Severity

from . import faults

FAIL, WARN = Severity.FAIL, Severity.WARN


def _pair(edit=lambda out: out):
    first = faults.recorded(1)
    return faults.parse(first), faults.parse(edit(faults.recorded(2)))


def _found(prev, cur, limits=None):
    return [(f.kind, f.severity, f.subject) for f in judge_node(prev, cur, limits)]


def test_steady_real_samples_raise_nothing():
    prev, cur = _pair()
    assert judge_node(prev, cur) == []
    assert judge_node(cur, cur) == []


def test_uncorrectable_ecc_increment_fails_that_gpu_only():
    prev, cur = _pair(lambda out: faults.ecc_increment(out, 1))
    findings = judge_node(prev, cur)
    assert [(f.kind, f.severity, f.subject) for f in findings] == [("ecc", FAIL, "gpu 1"), ("ecc", FAIL, "gpu 1")]
    assert "volatile) +1: 0 -> 1" in findings[0].message and findings[0].node == "h200"
    assert "drain the node" in findings[0].fix


def test_standing_ecc_total_is_not_judged_again_and_a_reset_is_not_an_increase():
    bad = faults.parse(faults.ecc_increment(faults.recorded(1), 0, by=5))
    assert judge_node(bad, bad) == []
    assert judge_node(bad, faults.parse(faults.recorded(2))) == []  # 5 -> 0: reset (driver reload)


def test_pending_row_remap_fails_that_gpu():
    prev, cur = _pair(lambda out: faults.remap_pending(out, 0))
    assert _found(prev, cur) == [("row_remap", FAIL, "gpu 0")]
    assert judge_node(cur, cur) == []


def test_new_hardware_xid_fails_the_gpu_on_that_bus_and_application_xid_warns():
    prev, cur = _pair(lambda out: faults.add_kernel_lines(out, faults.XID_79_GPU1, faults.XID_13_GPU0))
    findings = judge_node(prev, cur)
    assert [(f.kind, f.severity, f.subject) for f in findings] == [("xid", FAIL, "gpu 1"), ("xid", WARN, "gpu 0")]
    assert findings[0].message.startswith("hardware XID 79:")
    assert findings[1].message.startswith("application-level XID 13:")


def test_an_xid_already_seen_is_not_new():
    prev = faults.parse(faults.add_kernel_lines(faults.recorded(1), faults.XID_79_GPU1))
    cur = faults.parse(faults.add_kernel_lines(faults.recorded(2), faults.XID_79_GPU1))
    assert judge_node(prev, cur) == []
    later = "[ 4800.5] NVRM: Xid (PCI:0000:00:06): 94, pid=1, Contained ECC error"
    cur = faults.parse(faults.add_kernel_lines(faults.recorded(2), faults.XID_79_GPU1, later))
    assert _found(prev, cur) == [("xid", FAIL, "gpu 0")]


def test_xid_without_timestamps_is_new_by_line():
    prev = faults.parse(faults.with_section(faults.recorded(1), "kernel_log", ""))
    line = "NVRM: Xid (PCI:0000:00:07): 31, pid=77, name=python3, Ch 00000008, MMU Fault"
    cur = faults.parse(faults.with_section(faults.recorded(2), "kernel_log", line))
    assert _found(prev, cur) == [("xid", WARN, "gpu 1")]
    assert judge_node(cur, cur) == []


def _with_ib(states, counters=None):
    return lambda out: faults.with_section(out, "ib", faults.ib_text(states, counters))


def test_ib_port_going_down_fails_that_port_only():
    prev = faults.parse(_with_ib({"mlx5_0/1": "4: ACTIVE", "mlx5_1/1": "4: ACTIVE"},
                                 {"mlx5_0/1": {"link_downed": 0}})(faults.recorded(1)))
    cur = faults.parse(_with_ib({"mlx5_0/1": "1: DOWN", "mlx5_1/1": "4: ACTIVE"},
                                {"mlx5_0/1": {"link_downed": 1}})(faults.recorded(2)))
    findings = judge_node(prev, cur)
    assert [(f.kind, f.severity, f.subject) for f in findings] == [("link", FAIL, "mlx5_0/1"),
                                                                  ("ib_counter", FAIL, "mlx5_0/1")]
    assert findings[0].message == "IB port ACTIVE -> DOWN (Disabled)"


def test_an_ib_port_that_went_down_and_is_active_again_is_a_link_warning_not_a_failure():
    """As a carrier flap (issue 36): link_downed rose but the port is ACTIVE in both samples; whether the run rode
    it out is rollout/monitors.grade_flaps' call. Down now, it stays a failure (the test above)."""
    prev = faults.parse(_with_ib({"mlx5_0/1": "4: ACTIVE"}, {"mlx5_0/1": {"link_downed": 2}})(faults.recorded(1)))
    cur = faults.parse(_with_ib({"mlx5_0/1": "4: ACTIVE"}, {"mlx5_0/1": {"link_downed": 3}})(faults.recorded(2)))
    findings = judge_node(prev, cur)
    assert [(f.kind, f.severity, f.subject) for f in findings] == [("link", WARN, "mlx5_0/1")]
    assert "link_downed 2 -> 3; now ACTIVE" in findings[0].message


def test_ib_error_counters_warn_on_increase_and_congestion_counters_do_not():
    counters = {"symbol_error": 2, "port_xmit_wait": 10, "local_ack_timeout_err": 0}
    prev = faults.parse(_with_ib({"mlx5_0/1": "4: ACTIVE"}, {"mlx5_0/1": counters})(faults.recorded(1)))
    steady = faults.parse(_with_ib({"mlx5_0/1": "4: ACTIVE"},
                                   {"mlx5_0/1": {**counters, "port_xmit_wait": 99999}})(faults.recorded(2)))
    assert judge_node(prev, steady) == []
    worse = faults.parse(_with_ib({"mlx5_0/1": "4: ACTIVE"}, {"mlx5_0/1": {
        **counters, "symbol_error": 5, "local_ack_timeout_err": 4}})(faults.recorded(2)))
    findings = judge_node(prev, worse)
    assert [(f.kind, f.severity, f.message) for f in findings] == [
        ("ib_counter", WARN, "symbol_error +3 (2 -> 5)"), ("ib_counter", WARN, "local_ack_timeout_err +4 (0 -> 4)")]


def test_a_port_that_was_never_active_raises_nothing():
    prev = faults.parse(_with_ib({"mlx5_1/1": "1: DOWN"})(faults.recorded(1)))
    assert judge_node(prev, faults.parse(_with_ib({"mlx5_1/1": "1: DOWN"})(faults.recorded(2)))) == []


def test_netdev_down_fails_and_errors_warn():
    prev, cur = _pair(lambda out: faults.set_operstate(out, "eth0", "down"))
    assert _found(prev, cur) == [("link", FAIL, "eth0")]
    body = faults.section(faults.recorded(2), "net").replace("eth0/statistics/rx_errors:0",
                                                             "eth0/statistics/rx_errors:12")
    prev, cur = _pair(lambda out: faults.with_section(out, "net", body))
    assert _found(prev, cur) == [("netdev", WARN, "eth0")]


def test_nvidia_smi_failing_mid_run_fails_and_a_lost_gpu_fails():
    broken = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    prev, cur = _pair(lambda out: faults.with_section(out, "gpu", broken, rc=9))
    findings = judge_node(prev, cur)
    assert [(f.kind, f.severity, f.subject) for f in findings] == [("unreadable", FAIL, "gpu")]
    one = faults.section(faults.recorded(2), "gpu").splitlines()[0]
    prev, cur = _pair(lambda out: faults.with_section(out, "gpu", one))
    assert _found(prev, cur) == [("gpu_lost", FAIL, "gpu 1")]


def test_disk_filling_up_is_reported_once_per_level():
    def disk(free_kib):
        return lambda out: faults.with_section(out, "disk", "/ckpt\nFilesystem 1024-blocks Used Available Capacity "
                                                            f"Mounted on\n/dev/vda 1000000 0 {free_kib} 50% /")
    prev = faults.parse(disk(500000)(faults.recorded(1)))
    low = faults.parse(disk(50000)(faults.recorded(2)))
    full = faults.parse(disk(10000)(faults.recorded(2)))
    assert _found(prev, low) == [("disk", WARN, "/ckpt")]
    assert judge_node(low, low) == []
    assert _found(low, full) == [("disk", FAIL, "/ckpt")]
    assert _found(prev, full, MonitorLimits(disk_min_free=0.0)) == []
