"""Wall time of `stepdeploy provision` (first run, idempotent re-run) against plain `ansible-playbook`
running the same playbook with the same environment (a second re-run), on N simulated nodes.

    python bench/provision_timing.py --nodes 2 8 [--profile sim-cpu]

The wrapper's overhead is the ratio of its re-run to the plain re-run (both change nothing). Uses its own
cluster name and subnet. Prints one JSON line per node count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stepdeploy.ansible_run import runner_env
from stepdeploy.provision.runner import playbooks_dir, roles_dir
from stepdeploy.sim.cluster import SimConfig, down, up

ROOT = Path(__file__).resolve().parents[1]


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    return time.monotonic() - started, proc.returncode, proc.stdout


def measure(nodes: int, profile: str, state_dir: Path) -> dict:
    cfg = SimConfig(name="sdprov", subnet="10.85.0.0/24", http_port=8087, state_dir=state_dir)
    up(cfg, nodes)
    try:
        inv = cfg.dir / "inventory-bench.ini"
        inv.write_text(cfg.inventory.read_text().replace("stepdeploy_profile=sim-cpu", f"stepdeploy_profile={profile}"))
        provision = [sys.executable, "-m", "stepdeploy", "provision", str(inv), "--json"]
        first, rc1, _ = timed(provision)
        again, rc2, out = timed(provision)
        changed = {h: v["changed"] for h, v in json.loads(out)["hosts"].items()} if rc2 == 0 else None
        env = {**os.environ, **runner_env({"ANSIBLE_ROLES_PATH": str(roles_dir())})}
        plain, rc3, _ = timed([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inv),
                               str(playbooks_dir() / "site.yml")], env=env)
        return {"nodes": nodes, "profile": profile, "first_run_s": round(first, 1), "rerun_s": round(again, 1),
                "rerun_changed": changed, "plain_ansible_playbook_rerun_s": round(plain, 1),
                "wrapper_over_plain": round(again / plain, 3), "exit_codes": [rc1, rc2, rc3]}
    finally:
        down(cfg)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--profile", default="sim-cpu")
    args = parser.parse_args()
    for n in args.nodes:
        with tempfile.TemporaryDirectory(prefix="sdprov-") as tmp:
            print(json.dumps(measure(n, args.profile, Path(tmp) / "sdprov")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
