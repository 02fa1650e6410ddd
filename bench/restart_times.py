"""Each injected kill of a soak, kill to the end of the first new step, part by part, from the run's ledger (the
`inject` events and the soak's `goodput` event, which `stepdeploy rollout run` writes): issue 37's measure.

    python bench/restart_times.py RUN_DIR [--json]

Parts: detection and stop (the kill to the controller's stop), restart (the stop to the next launch), then the
start's own parts (launch, imports + process group, model build, checkpoint load, set-up), then the first step
itself. The median of the kills is printed last. Reads the ledger only; no node is contacted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from stepdeploy.ledger import Ledger

START_PARTS = ("launch", "imports_init", "model_build", "checkpoint_load", "setup")


def restarts(run_dir: Path) -> list[dict[str, Any]]:
    ledger = Ledger(run_dir / "ledger.sqlite", create=False)
    try:
        run_id = ledger.run_ids()[-1]
        # the injection's own event (its spec and time), not the one saying how it went
        kills = sorted(float(e["data"]["time"]) for e in ledger.events(run_id, kind="inject")
                       if str(e["data"].get("spec", "")).startswith("kill") and "time" in e["data"])
        goodput = next((e["data"] for e in reversed(ledger.events(run_id, kind="goodput"))), None)
    finally:
        ledger.close()
    if goodput is None:
        raise SystemExit(f"{run_dir}: the soak wrote no goodput event")
    starts = sorted(goodput["starts"], key=lambda s: s["began"])
    failures = sorted(goodput["failures"], key=lambda f: f["detected_at"])
    rows = []
    for kill in kills:
        start = next((s for s in starts if s["began"] > kill and s["first_step"] is not None), None)
        failure = next((f for f in failures if f["detected_at"] >= kill), None)
        if start is None or failure is None:
            rows.append({"kill": kill, "total_s": None})
            continue
        first_step_s = start["parts"].get("first_step_extra", 0.0)
        # the end of the first new step: its beginning plus its own time (steady + extra)
        end = start["first_step"] + first_step_s + (goodput.get("steady_step_s") or 0.0)
        row = {"kill": kill, "total_s": round(end - kill, 2),
               "detection_s": round(failure["detected_at"] - kill, 2),
               "stop_s": round(failure["parts"].get("stop", 0.0), 2),
               "restart_s": round(failure["parts"].get("restart", 0.0), 2),
               "resumed_from": start["resumed_from"]}
        row |= {f"{name}_s": round(start["parts"].get(name, 0.0), 2) for name in START_PARTS}
        row["first_step_s"] = round(first_step_s + (goodput.get("steady_step_s") or 0.0), 2)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = restarts(args.run_dir)
    totals = [r["total_s"] for r in rows if r["total_s"] is not None]
    if args.json:
        print(json.dumps({"kills": rows, "median_s": statistics.median(totals) if totals else None}))
        return 0
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    print(f"kills {len(rows)}, restarted {len(totals)}, median kill to the end of the first new step: "
          + (f"{statistics.median(totals):.2f} s" if totals else "n/a"))
    return 0 if totals else 1


if __name__ == "__main__":
    sys.exit(main())
