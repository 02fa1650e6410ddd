"""The optimizer layouts' runs against the plan (issue 22; bench/gpu_optim.sh makes the inputs): one table row per
layout, measured against `stepdeploy plan --json`, and the same as one JSON document.

DIR holds, per layout NAME: metrics-NAME.jsonl (the run's fetched metrics.jsonl, one object per iteration),
plan-NAME.json (`stepdeploy plan ... --layout LAYOUT --json`) and launch-NAME.log (`run launch --follow`'s output,
its last line `exit CODE after SECONDS s`). Measured: the median step_time_s and optimizer_s of iterations FIRST to
LAST (the first ones compile and warm the allocator), the peak of mem_peak_gib over the run (torch's
max_memory_allocated) and the last loss. Plan: the step's seconds and its optimizer part, the worst stage's torch
allocated, and the optimizer the plan says it assumed. A ratio is measured / plan. Standard library only.

    python3 bench/optim_table.py DIR foreach=mbs=4 fused=mbs=4,optimizer=fused [--first 6 --last 20] [--json F]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

GIB = 2**30
COLUMNS = ("layout", "optimizer (plan)", "exit", "step s", "plan", "ratio", "optimizer s", "plan", "ratio",
           "peak GiB", "plan", "ratio")


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(row, dict) and isinstance(row.get("iteration"), int):
            rows.append(row)
    return rows


def measured(path: Path, first: int, last: int) -> dict[str, Any] | None:
    rows = _rows(path)
    window = [row for row in rows if first <= row["iteration"] <= last]
    if not window:
        return None
    return {
        "iterations": len(window),
        "step_s": statistics.median(row["step_time_s"] for row in window),
        "optimizer_s": statistics.median(row["optimizer_s"] for row in window) if all(
            "optimizer_s" in row for row in window) else None,
        "peak_gib": max(row["mem_peak_gib"] for row in rows),
        "last_loss": rows[-1].get("loss"),
    }


def planned(path: Path) -> dict[str, Any] | None:
    try:
        verdict = json.loads(path.read_text())["layout"]
        stages = verdict["memory_bytes"]["stages"]
        worst = max(stages, key=lambda stage: stage["total"])
        return {"step_s": verdict["step"]["seconds"], "optimizer_s": verdict["step"]["optimizer"],
                "torch_allocated_gib": worst["torch_allocated"] / GIB,
                "optimizer_assumed": verdict.get("optimizer_assumed")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def launch_exit(path: Path) -> int | None:
    lines = path.read_text().splitlines() if path.is_file() else []
    match = re.fullmatch(r"exit (\d+) after \d+ s", lines[-1]) if lines else None
    return int(match.group(1)) if match else None


def _ratio(measure: float | None, plan: float | None) -> float | None:
    return round(measure / plan, 3) if measure is not None and plan else None


def compare(directory: Path, layouts: list[tuple[str, str]], first: int, last: int) -> list[dict[str, Any]]:
    results = []
    for name, layout in layouts:
        got, plan = measured(directory / f"metrics-{name}.jsonl", first, last), planned(directory / f"plan-{name}.json")
        result: dict[str, Any] = {"name": name, "layout": layout, "exit": launch_exit(directory / f"launch-{name}.log"),
                                  "measured": got, "plan": plan}
        if got and plan:
            result["ratio"] = {"step": _ratio(got["step_s"], plan["step_s"]),
                               "optimizer": _ratio(got["optimizer_s"], plan["optimizer_s"]),
                               "peak": _ratio(got["peak_gib"], plan["torch_allocated_gib"])}
        results.append(result)
    return results


def _cell(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for result in results:
        got, plan, ratio = result["measured"] or {}, result["plan"] or {}, result.get("ratio", {})
        assumed = plan.get("optimizer_assumed") or {}
        cells = [f"`{result['layout']}`", f"{assumed.get('implementation', '?')} on {assumed.get('device', '?')}",
                 _cell(result["exit"]),
                 _cell(got.get("step_s")), _cell(plan.get("step_s")), _cell(ratio.get("step")),
                 _cell(got.get("optimizer_s")), _cell(plan.get("optimizer_s")), _cell(ratio.get("optimizer")),
                 _cell(got.get("peak_gib"), 2), _cell(plan.get("torch_allocated_gib"), 2), _cell(ratio.get("peak"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _layout_arg(text: str) -> tuple[str, str]:
    name, sep, layout = text.partition("=")
    if not sep or not re.fullmatch(r"[a-z0-9_-]+", name) or not layout:
        raise argparse.ArgumentTypeError(f"expected NAME=LAYOUT (e.g. foreach=mbs=4), got {text!r}")
    return name, layout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("layouts", nargs="+", type=_layout_arg, metavar="NAME=LAYOUT")
    parser.add_argument("--first", type=int, default=6)
    parser.add_argument("--last", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the comparison here as one JSON document")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        print(f"error: {args.directory} is not a directory", file=sys.stderr)
        return 2
    results = compare(args.directory, args.layouts, args.first, args.last)
    print(table(results))
    if args.json:
        document = {"iterations": [args.first, args.last], "layouts": results}
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    complete = all(r["exit"] == 0 and r["measured"] and r["plan"] for r in results)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
