"""preflight on its own simulated cluster, over real SSH: the real CLI end to end (gloo sweep across the
nodes), GPU faults through a stand-in nvidia-smi that serves outputs recorded on an H200 machine, a
package that differs between nodes (installed with apt from the local repository), and an unreachable node."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepdeploy.inventory import load_cluster
from stepdeploy.preflight import runner
from stepdeploy.preflight.model import Report, Status
from stepdeploy.remote.ssh import Endpoint, connection
from stepdeploy.sim import repo
from stepdeploy.sim.cluster import SimConfig

from .conftest import private_cluster

FIXTURES = Path(__file__).parents[1] / "fixtures" / "h200-x2"
STANDIN_DIR = "/usr/local/share/stepdeploy-nvidia-smi"
SMI_FILES = ("nvidia-smi-q.xml", "nvidia-smi-topo-m.txt", "nvidia-smi-L.txt", "nvidia-smi.txt",
             "nvidia-smi-query-gpu.csv")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimConfig]:
    with private_cluster(tmp_path_factory, "sdpre", "10.82.0.0/24", 8084) as cfg:
        yield cfg


def _endpoint(cfg: SimConfig, index: int) -> Endpoint:
    return Endpoint(host=cfg.address(index), key_file=cfg.client_key, known_hosts=cfg.known_hosts)


def _sh(cfg: SimConfig, index: int, command: str) -> str:
    with connection(_endpoint(cfg, index)) as conn:
        return conn.run(command, hide=True).stdout


def _install_standin(cfg: SimConfig, index: int, xml: str) -> None:
    with connection(_endpoint(cfg, index)) as conn:
        conn.run(f"mkdir -p {STANDIN_DIR}", hide=True)
        for name in SMI_FILES:
            conn.put(str(FIXTURES / name), f"{STANDIN_DIR}/{name}")
        conn.put(str(FIXTURES / "nvidia-smi-standin.sh"), "/usr/local/bin/nvidia-smi")
        conn.run(f"chmod 755 /usr/local/bin/nvidia-smi && cat > {STANDIN_DIR}/nvidia-smi-q.xml", hide=True,
                 in_stream=_Stdin(xml))


class _Stdin:
    """A file-like stdin for Fabric (the xml variant is written by the node's own `cat`)."""

    def __init__(self, text: str) -> None:
        self._data, self._done = text, False

    def read(self, _n: int = -1) -> str:
        if self._done:
            return ""
        self._done = True
        return self._data


def _remove_standin(cfg: SimConfig) -> None:
    for index in (1, 2):
        _sh(cfg, index, f"rm -rf /usr/local/bin/nvidia-smi {STANDIN_DIR}")


def _gpu_nodes(cfg: SimConfig):
    cluster = load_cluster(cfg.inventory)
    return [n.model_copy(update={"gpus_per_node": 2, "gpu_model": "H200"}) for n in cluster.nodes]


def _run(cfg: SimConfig, nodes=None, **opts) -> Report:
    nodes = nodes or load_cluster(cfg.inventory).nodes
    options = runner.Options(min_free_gib=0.1, bandwidth=False, timeout_s=30, **opts)
    return runner.run(nodes, None, options)


def _status(report: Report, check: str, node: str | None) -> Status:
    result = report.result(check, node)
    assert result is not None, f"no {check} result for {node}: {report.to_json()}"
    return result.status


def test_cli_on_a_healthy_cluster_passes_with_a_gloo_sweep_across_nodes(cluster: SimConfig) -> None:
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "stepdeploy", "preflight", str(cluster.inventory), "--json",
                          "--min-free-gib", "0.1", "--sizes", "64K,1M", "--iters", "5"],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(res.stdout)
    results = {(r["check"], r["node"]): r for r in data["results"]}
    for node in ("node1", "node2"):
        assert results[("os", node)]["status"] == "ok"
        assert results[("torch", node)]["observed"].startswith("2.13.0")
        assert results[("train_iface", node)]["status"] == "ok"
        assert results[("gpus", node)]["status"] == "skip"
    assert results[("reachability", None)]["status"] == "ok"
    assert results[("reachability", None)]["observed"].startswith("2 of 2")
    assert results[("same_versions", None)]["status"] == "ok"
    assert results[("clock", None)]["status"] == "ok"
    assert results[("compat", None)]["status"] == "ok"
    assert results[("busbw", None)]["status"] == "ok"
    assert [r["size_bytes"] for r in data["bandwidth"]] == [65536, 1048576]
    assert all(r["world"] == 2 and r["correct"] and r["busbw_gbps"] > 0 for r in data["bandwidth"])
    assert time.monotonic() - started < 120


FAULTS = {
    "uncorrectable_ecc": (lambda x: x.replace("<dram_uncorrectable>0</dram_uncorrectable>",
                                              "<dram_uncorrectable>2</dram_uncorrectable>", 1), "ecc"),
    "pending_row_remap": (lambda x: x.replace("<remapped_row_pending>No</remapped_row_pending>",
                                              "<remapped_row_pending>Yes</remapped_row_pending>", 1), "row_remap"),
    "missing_gpu": (lambda x: x[:x.index('<gpu id="00000000:00:07.0">')] + "</nvidia_smi_log>\n", "gpus"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_gpu_fault_on_node2_is_caught_there_only(cluster: SimConfig, fault: str) -> None:
    clean = (FIXTURES / "nvidia-smi-q.xml").read_text()
    inject, check = FAULTS[fault]
    faulty = inject(clean)
    assert faulty != clean
    try:
        _install_standin(cluster, 1, clean)
        _install_standin(cluster, 2, faulty)
        report = _run(cluster, _gpu_nodes(cluster))
    finally:
        _remove_standin(cluster)
    assert report.unreachable == {}
    assert _status(report, check, "node2") is Status.FAIL, report.result(check, "node2")
    assert _status(report, check, "node1") is Status.OK, report.result(check, "node1")
    assert report.result(check, "node2").fix
    assert report.exit_code == 1
    assert _status(report, "gpus", "node1") is Status.OK
    assert "2x NVIDIA H200 143771 MiB" in report.result("gpus", "node1").observed


def test_a_different_driver_on_one_node_fails_the_cross_node_check(cluster: SimConfig) -> None:
    clean = (FIXTURES / "nvidia-smi-q.xml").read_text()
    older = clean.replace("<driver_version>580.159.04</driver_version>", "<driver_version>570.172.08</driver_version>")
    try:
        _install_standin(cluster, 1, clean)
        _install_standin(cluster, 2, older)
        report = _run(cluster, _gpu_nodes(cluster))
    finally:
        _remove_standin(cluster)
    same = report.result("same_versions")
    assert same is not None and same.status is Status.FAIL
    assert "driver: node1=580.159.04, node2=570.172.08" in same.observed
    assert report.result("driver", "node2").observed == "570.172.08"


def _build_deb(tmp_path: Path, name: str, version: str) -> Path:
    pkg = tmp_path / f"{name}-{version}"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: stepdeploy tests <t@invalid>\n"
        "Description: stand-in for NVIDIA's NCCL runtime package (preflight tests)\n")
    deb = tmp_path / f"{name}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(deb)], check=True,
                   capture_output=True)
    return deb


def test_a_different_nccl_package_on_node2_is_found(cluster: SimConfig, tmp_path: Path) -> None:
    new, old = "2.28.3-1+cuda13.0", "2.27.7-1+cuda12.9"
    repo.publish(cluster.dir, [_build_deb(tmp_path, "libnccl2", new), _build_deb(tmp_path, "libnccl2", old)])
    try:
        for index, version in ((1, new), (2, old)):
            _sh(cluster, index, f"apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                                f"--allow-downgrades libnccl2={version}")
        report = _run(cluster)
    finally:
        for index in (1, 2):
            _sh(cluster, index, "dpkg -r libnccl2 >/dev/null 2>&1 || true")
    same = report.result("same_versions")
    assert same is not None and same.status is Status.FAIL
    assert f"libnccl2: node1={new}, node2={old}" in same.observed
    assert report.result("nccl", "node2").observed == f"libnccl2 {old}"
    assert report.exit_code == 1


def test_an_unreachable_node_is_reported_within_the_timeout_and_the_other_still_checked(cluster: SimConfig) -> None:
    sim_state = json.loads((cluster.dir / "state.json").read_text())
    netns = sim_state["nodes"][1]["netns"]
    subprocess.run(["ip", "-n", netns, "link", "set", "eth0", "down"], check=True)
    try:
        started = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "stepdeploy", "preflight", str(cluster.inventory), "--json",
                              "--min-free-gib", "0.1", "--timeout", "8", "--no-bandwidth"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"})
        elapsed = time.monotonic() - started
    finally:
        subprocess.run(["ip", "-n", netns, "link", "set", "eth0", "up"], check=True)
    assert res.returncode == 3, res.stdout + res.stderr
    data = json.loads(res.stdout)
    assert list(data["unreachable"]) == ["node2"]
    statuses = {(r["check"], r["node"]): r["status"] for r in data["results"]}
    assert statuses[("os", "node1")] == "ok" and statuses[("torch", "node1")] == "ok"
    assert statuses[("reach_node", "node2")] == "fail"
    assert ("os", "node2") not in statuses
    assert statuses[("coverage", None)] == "warn"
    assert elapsed < 8 + 15 + 15, f"took {elapsed:.1f} s"


# the probe's choice of interpreter (probe.DEFAULT_PYTHONS), asked where its packages go
SITE_PACKAGES = ("for p in /opt/stepdeploy/venv/bin/python python3; do if command -v \"$p\" >/dev/null 2>&1; then "
                 "exec \"$p\" -I -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'; fi; done; exit 127")


def test_a_cp_layout_needs_transformer_engine_on_every_node(cluster: SimConfig) -> None:
    """TransformerEngine is collected on each node (a stand-in distribution on node1, none on node2) and judged
    against what `--layout cp=2` of tiny-moe needs: node1 passes, node2 fails (and only that), exit 1."""
    site = _sh(cluster, 1, SITE_PACKAGES).strip()
    info, package = (shlex.quote(f"{site}/{name}") for name in ("transformer_engine-9.9.9.dist-info",
                                                                  "transformer_engine"))
    standin = (f"mkdir -p {info} {package} && "
               f"printf 'Metadata-Version: 2.1\\nName: transformer_engine\\nVersion: 9.9.9\\n' > {info}/METADATA && "
               f": > {package}/__init__.py && : > {package}/pytorch.py")
    try:
        _sh(cluster, 1, standin)
        res = subprocess.run([sys.executable, "-m", "stepdeploy", "preflight", str(cluster.inventory), "--json",
                              "--min-free-gib", "0.1", "--no-bandwidth", "--model", "tiny-moe",
                              "--layout", "cp=2"], capture_output=True, text=True, timeout=240)
    finally:
        _sh(cluster, 1, f"rm -rf {info} {package}")
    assert res.returncode == 1, res.stdout + res.stderr
    results = {(r["check"], r["node"]): r for r in json.loads(res.stdout)["results"]}
    node1, node2 = results[("transformer_engine", "node1")], results[("transformer_engine", "node2")]
    assert (node1["status"], node1["observed"]) == ("ok", "9.9.9: the layout's need is met")
    assert (node2["status"], node2["observed"]) == ("fail", "not installed")
    assert "any cp_comm_type" in node2["expected"] and "transformer_engine" in node2["fix"]
    failed = {key for key, r in results.items() if r["status"] == "fail"}
    assert failed == {("transformer_engine", "node2"), ("same_versions", None)}, failed
    assert "transformer-engine: node1=9.9.9, node2=none" in results[("same_versions", None)]["observed"]
