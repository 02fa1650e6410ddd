"""Wall time of `sim up` (cold and warm base cache) and `sim down` for N nodes.

    python bench/sim_timings.py --nodes 2 8 [--cold]

--cold deletes the cached base image first (the next `up` rebuilds it: debootstrap + node venv), so the
first figure includes the build. Uses its own cluster name so it never touches the demo cluster.
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from stepdeploy.sim import base
from stepdeploy.sim.cluster import SimConfig, down, up


def measure(nodes: int, state_dir: Path) -> dict:
    cfg = SimConfig(name="sdbench", subnet="10.80.0.0/24", http_port=8082, state_dir=state_dir)
    t0 = time.monotonic()
    up(cfg, nodes)
    t_up = time.monotonic() - t0
    t0 = time.monotonic()
    report = down(cfg)
    t_down = time.monotonic() - t0
    return {"nodes": nodes, "up_s": round(t_up, 2), "down_s": round(t_down, 2),
            "leftovers": report.leftovers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--cold", action="store_true", help="delete the cached base first")
    args = parser.parse_args()
    recipe = base.BaseRecipe()
    if args.cold:
        shutil.rmtree(base.base_dir(recipe), ignore_errors=True)
        shutil.rmtree(base.wheelhouse_dir(), ignore_errors=True)
    for i, n in enumerate(args.nodes):
        with tempfile.TemporaryDirectory(prefix="sdbench-") as tmp:
            row = measure(n, Path(tmp) / "sdbench")
        row["base_cache"] = "cold" if args.cold and i == 0 else "warm"
        print(json.dumps(row), flush=True)
        if row["leftovers"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
