"""preflight's wall time on N simulated nodes vs the same per-node checks through `ansible all -m shell`.

    python bench/preflight_scale.py --nodes 2 8 [--repeat 3]

For each N: a fresh simulated cluster (its own name and subnet), then, `--repeat` times each,
(a) `runner.run` without the bandwidth sweep: the probe on every node over Fabric plus the cross-node
checks (versions, clock, compat, N x (N-1) reachability), and (b) `ansible all -f N -m shell -a PROBE`
with the identical probe script (per-node checks only, no cross-node step). Prints one JSON line per N
with the medians and the ratio ansible / preflight.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stepdeploy.inventory import load_cluster
from stepdeploy.preflight import probe, runner
from stepdeploy.sim.cluster import SimConfig, down, up


def _preflight(cfg: SimConfig) -> float:
    nodes = load_cluster(cfg.inventory).nodes
    t0 = time.monotonic()
    report = runner.run(nodes, None, runner.Options(bandwidth=False, min_free_gib=0.1, timeout_s=60))
    took = time.monotonic() - t0
    assert not report.unreachable, report.unreachable
    return took


def _ansible(cfg: SimConfig, forks: int) -> float:
    script = probe.script(probe.PreflightProbeSpec(train_iface="eth0"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "ANSIBLE_HOST_KEY_CHECKING": "True", "ANSIBLE_STDOUT_CALLBACK": "minimal"}
    t0 = time.monotonic()
    res = subprocess.run(["ansible", "all", "-i", str(cfg.inventory), "-f", str(forks), "-m", "ansible.builtin.shell",
                          "-a", script], capture_output=True, text=True, env=env, timeout=600)
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return took


def measure(nodes: int, repeat: int, state_dir: Path) -> dict:
    # The subnet preflight owns (tests/integration/test_preflight.py uses it too: do not run both at once).
    cfg = SimConfig(name="sdpre", subnet="10.82.0.0/24", http_port=8084, state_dir=state_dir)
    try:
        up(cfg, nodes)
        pre = [_preflight(cfg) for _ in range(repeat)]
        ans = [_ansible(cfg, nodes) for _ in range(repeat)]
    finally:
        report = down(cfg)
    p, a = statistics.median(pre), statistics.median(ans)
    return {"nodes": nodes, "preflight_s": round(p, 2), "ansible_shell_s": round(a, 2),
            "ratio_ansible_over_preflight": round(a / p, 2), "preflight_runs": [round(x, 2) for x in pre],
            "ansible_runs": [round(x, 2) for x in ans], "leftovers": report.leftovers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for n in args.nodes:
        with tempfile.TemporaryDirectory(prefix="sdpre-bench-") as tmp:
            row = measure(n, args.repeat, Path(tmp) / "sdpre")
        print(json.dumps(row), flush=True)
        if row["leftovers"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
