"""The probe command (quoted, every section under timeout, runs for real under sh) and the textfile."""

from __future__ import annotations

import os
import subprocess
import sys

from stepdeploy.monitor import probe, prometheus
from stepdeploy.workload import __file__ as workload_init

from . import faults

sys.path.insert(0, os.path.dirname(workload_init))  # metrics.py imports its sibling ckpt by plain name
from metrics import RankFiles


def test_every_section_runs_under_timeout_and_names_are_quoted():
    spec = probe.ProbeSpec(run_dir="/runs/a b", ifaces=("eth0;reboot",), checkpoint_dir="/ckpt/$(id)")
    text = probe.script(spec)
    assert text.count("timeout -k 2 10 sh -c") == len(probe.commands(spec)) == 11
    commands = probe.commands(spec)
    assert "'eth0;reboot'/operstate" in commands["net"]
    assert "d='/ckpt/$(id)';" in commands["disk"]
    assert "cd '/runs/a b/out/heartbeat'" in commands["heartbeats"]
    assert "cd '/runs/a b/out/status'" in commands["procs"]
    assert probe.remote_command(spec).endswith("| base64 -d | sh")


def test_probe_runs_under_sh_and_reads_the_workloads_own_files(tmp_path):
    files = RankFiles(tmp_path / "out", 1)
    files.heartbeat.parent.mkdir(parents=True)
    files.status.parent.mkdir(parents=True)
    files.started(world=2, local_rank=1)
    files.beat(41)
    files.record({"iteration": 41, "loss": float("nan"), "grad_norm": 1.5, "rank_step_time_s": [0.2, 0.3]})
    spec = probe.ProbeSpec(run_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "ckpt" / "not-yet"))
    output = subprocess.run(["sh", "-c", probe.remote_command(spec)], capture_output=True, text=True,
                            timeout=60).stdout
    sample = probe.parse(output, "local", spec, now=0.0)
    assert [(b.rank, b.iteration, b.pid) for b in sample.heartbeats] == [(1, 41, os.getpid())]
    assert [(r.rank, r.state) for r in sample.ranks] == [(1, "running")]
    assert list(sample.rank_proc_states) == [1] and sample.rank_proc_states[1] in ("R", "S")  # this process
    assert sample.metrics[0].iteration == 41 and sample.metrics[0].grad_norm == 1.5
    assert sample.disk is not None and sample.disk.path == str(tmp_path)
    assert "MemTotal" in sample.meminfo_kib and sample.time > 1.7e9
    assert set(sample.errors) <= {"kernel_log"}  # dmesg may be restricted here


def test_cut_off_output_and_a_cpu_node():
    output = faults.with_section(faults.recorded(1), "gpu", "sh: nvidia-smi: not found", rc=127)
    cut = output[: output.index(f"{probe.MARK} begin meminfo")]
    sample = faults.parse(cut)
    assert sample.gpus == () and "gpu" not in sample.errors
    assert sample.errors["meminfo"].startswith("section missing") and "disk" in sample.errors


def test_textfile_has_dcgm_names_and_labels_and_is_replaced_atomically(tmp_path):
    sample = faults.parse(faults.add_kernel_lines(faults.recorded(1), faults.XID_79_GPU1))
    text = prometheus.render([sample])
    labels = 'gpu="1",UUID="GPU-ea7ba64c-7710-52fe-4d5e-101b44ccc75c",pci_bus_id="00000000:00:07.0",Hostname="h200"'
    assert f"DCGM_FI_DEV_GPU_TEMP{{{labels}}} 33\n" in text
    assert f"DCGM_FI_DEV_POWER_USAGE{{{labels}}} 113.3\n" in text
    assert f"DCGM_FI_DEV_XID_ERRORS{{{labels}}} 79\n" in text
    assert 'DCGM_FI_DEV_XID_ERRORS{gpu="0",' in text and text.count("# TYPE DCGM_FI_DEV_GPU_UTIL gauge") == 1
    assert 'stepdeploy_netdev_up{device="eth0",Hostname="h200"} 1\n' in text
    assert 'stepdeploy_host_memory_total_bytes{Hostname="h200"} 270334464000\n' in text
    target = tmp_path / "textfile" / "stepdeploy.prom"
    prometheus.write_textfile(target, "old\n")
    prometheus.write_textfile(target, text)
    assert target.read_text() == text and os.listdir(target.parent) == ["stepdeploy.prom"]


def test_textfile_escapes_labels_and_writes_nan():
    out = faults.with_section(faults.recorded(1), "metrics", faults.metrics([(3, float("nan"), 1.0, [0.5])]))
    text = prometheus.render([faults.parse(out, node='evil"\\\nhost')])
    assert 'stepdeploy_train_loss{Hostname="evil\\"\\\\\\nhost"} NaN\n' in text
