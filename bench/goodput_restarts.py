"""Goodput's breakdown against the number of restarts (issue 36 item 3): a soak of N kills, each detected, stopped
and restarted from its last checkpoint (tests/unit/rollout/test_goodput_linear.py's `soak`, noise off: 1-6 steps
per attempt, a save now and then), timed with the breakdown of stepdeploy/rollout/goodput.py ("new": linear, one
forward walk per lookup list), with the same breakdown doing a binary search per start and failure instead of the walk
("bisect": the O(n log n) version it replaced) and with the quadratic one before that ("old", that test file's
`reference_breakdown`), all on the same rows, their results checked equal. Prints a markdown table: seconds (best of
--repeat), microseconds per restart (also with Python's cyclic garbage collector off: what the collector adds grows
with the heap, that is with the rows), bisect / new and old / new.

    .venv/bin/python bench/goodput_restarts.py [--sizes 100,1000,10000,100000] [--old-up-to 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import bisect
import gc
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unittest.mock import patch

from stepdeploy.rollout import goodput
from stepdeploy.rollout.goodput import Goodput, breakdown
from tests.unit.rollout.test_goodput_linear import reference_breakdown, soak


def _last_at_most_bisect(ordered: list[float], limits: list[float]) -> list[float | None]:
    """The lookup as it was before the walk: a binary search per limit."""
    found: list[float | None] = []
    for limit in limits:
        at = bisect.bisect_right(ordered, limit)
        ok = at > 0 and ordered[at - 1] <= limit
        found.append(ordered[bisect.bisect_left(ordered, ordered[at - 1])] if ok else None)
    return found


def _first_after_bisect(ordered: list[float], limits: list[float], *, strict: bool) -> list[float | None]:
    found: list[float | None] = []
    for limit in limits:
        at = (bisect.bisect_right if strict else bisect.bisect_left)(ordered, limit)
        x = ordered[at] if at < len(ordered) else None
        found.append(x if x is not None and (x > limit if strict else x >= limit) else None)
    return found


def bisect_breakdown(*args: Any) -> Goodput:
    """goodput.breakdown with a binary search per start and failure (its O(n log n) version) in place of the walks."""
    with patch.multiple(goodput, _last_at_most_each=_last_at_most_bisect, _first_after_each=_first_after_bisect):
        return breakdown(*args)


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
    parser.add_argument("--sizes", default="100,1000,10000,100000", help="restarts, comma-separated")
    parser.add_argument("--old-up-to", type=int, default=10000, help="time the quadratic breakdown up to this many")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (the best is shown)")
    args = parser.parse_args(argv)
    print("| restarts | metrics lines | phases | new s | new us/restart | same, gc off | bisect s | bisect / new "
          "| old s | old / new |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for restarts in (int(s) for s in args.sizes.split(",")):
        rows = soak(restarts, random.Random(restarts), noise=False)
        new_s, new = _best(breakdown, rows, args.repeat)
        bare_s, _ = _best(breakdown, rows, args.repeat, collect=False)
        assert len(new.failures) == restarts and len(new.starts) == restarts + 1
        bisect_s, previous = _best(bisect_breakdown, rows, args.repeat)
        assert repr(previous) == repr(new), f"{restarts} restarts: the bisect breakdown differs"
        old = ratio = "-"
        if restarts <= args.old_up_to:
            old_s, reference = _best(reference_breakdown, rows, 1)
            assert repr(reference) == repr(new), f"{restarts} restarts: the breakdowns differ"
            old, ratio = f"{old_s:.3f}", f"{old_s / new_s:.0f}x"
        print(f"| {restarts:,} | {len(rows[2]):,} | {len(rows[3]):,} | {new_s:.4f} | {new_s / restarts * 1e6:.1f} "
              f"| {bare_s / restarts * 1e6:.1f} | {bisect_s:.4f} | {bisect_s / new_s:.2f}x | {old} | {ratio} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
