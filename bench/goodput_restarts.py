"""Goodput's breakdown against the number of restarts (issue 36 item 3): a soak of N kills, each detected, stopped
and restarted from its last checkpoint (tests/unit/rollout/test_goodput_linear.py's `soak`, noise off: 1-6 steps
per attempt, a save now and then), timed with the breakdown of stepdeploy/rollout/goodput.py ("new") and with the
quadratic one it replaced ("old", that test file's `reference_breakdown`), both on the same rows, their results
checked equal. Prints a markdown table: seconds (best of --repeat), microseconds per restart (also with Python's
cyclic garbage collector off: what the collector adds grows with the heap, that is with the rows), old / new.

    .venv/bin/python bench/goodput_restarts.py [--sizes 100,1000,6000,20000] [--old-up-to 6000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stepdeploy.rollout.goodput import breakdown
from tests.unit.rollout.test_goodput_linear import reference_breakdown, soak


def _best(function: Callable[..., Any], args: tuple[Any, ...], repeat: int, collect: bool = True
          ) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        gc.collect()
        if not collect:
            gc.disable()
        try:
            began = time.perf_counter()
            result = function(*args)
            best = min(best, time.perf_counter() - began)
        finally:
            gc.enable()
    return best, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,6000,20000", help="restarts, comma-separated")
    parser.add_argument("--old-up-to", type=int, default=6000, help="time the old breakdown up to this many")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (the best is shown)")
    args = parser.parse_args(argv)
    print("| restarts | metrics lines | phases | new s | new us/restart | same, gc off | old s | old / new |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for restarts in (int(s) for s in args.sizes.split(",")):
        rows = soak(restarts, random.Random(restarts), noise=False)
        new_s, new = _best(breakdown, rows, args.repeat)
        bare_s, _ = _best(breakdown, rows, args.repeat, collect=False)
        assert len(new.failures) == restarts and len(new.starts) == restarts + 1
        old = "-"
        ratio = "-"
        if restarts <= args.old_up_to:
            old_s, reference = _best(reference_breakdown, rows, 1)
            assert repr(reference) == repr(new), f"{restarts} restarts: the breakdowns differ"
            old, ratio = f"{old_s:.3f}", f"{old_s / new_s:.0f}x"
        print(f"| {restarts:,} | {len(rows[2]):,} | {len(rows[3]):,} | {new_s:.4f} | {new_s / restarts * 1e6:.1f} "
              f"| {bare_s / restarts * 1e6:.1f} | {old} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
