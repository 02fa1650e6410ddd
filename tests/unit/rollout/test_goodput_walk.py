"""Goodput's lookups are one forward walk each (issue 36 item 3), seen without a clock: every value the walks compare
counts its comparisons, and a breakdown of thousands of restarts stays within a fixed number of comparisons per row
(a binary search per start or failure needs ~log2(n) per lookup, a scan per lookup n: both fail the bound). The
answers, ordered input or not (the sort-once fallback), are those of the plain max()/next() they replace."""

from __future__ import annotations

import math
import random
from typing import Any
from unittest.mock import patch

from hypothesis import given
from hypothesis import strategies as st

from stepdeploy.rollout import goodput

from .test_goodput_linear import soak


class Counted(float):
    """A float that counts the comparisons it takes part in (all instances share one counter)."""

    compared = 0

    def _count(self) -> None:
        Counted.compared += 1

    def __lt__(self, other: object) -> bool:
        self._count()
        return float(self) < float(other)  # type: ignore[arg-type]

    def __le__(self, other: object) -> bool:
        self._count()
        return float(self) <= float(other)  # type: ignore[arg-type]

    def __gt__(self, other: object) -> bool:
        self._count()
        return float(self) > float(other)  # type: ignore[arg-type]

    def __ge__(self, other: object) -> bool:
        self._count()
        return float(self) >= float(other)  # type: ignore[arg-type]

    __hash__ = float.__hash__


def _counting(values: list[float]) -> list[Counted]:
    return [Counted(v) for v in values]


def _compared(run: Any) -> int:
    Counted.compared = 0
    run()
    return Counted.compared


def test_a_walk_compares_each_value_a_bounded_number_of_times() -> None:
    n = m = 4096
    rng = random.Random(5)
    ordered = _counting(sorted(rng.choice(range(n // 2)) / 2 for _ in range(n)))  # ties everywhere
    limits = _counting(sorted(rng.uniform(-1, n / 4 + 1) for _ in range(m)))
    bound = 2 * n + 2 * m  # walking on: one or two per element passed, one per limit stopped at, plus the order check
    last = _compared(lambda: goodput._last_at_most_each(ordered, limits))
    after = _compared(lambda: goodput._first_after_each(ordered, limits, strict=True))
    # a binary search per limit: m * log2(n) = 49,152 comparisons
    assert 0 < last <= bound and 0 < after <= bound, (last, after, bound)


def test_a_breakdown_of_many_restarts_walks_each_row_a_bounded_number_of_times() -> None:
    """The whole breakdown: the lookups see each start, failure, launch, stop and seen time a bounded number of times
    (counted by handing the walks counting values), and no lookup is made per start or per failure."""
    sizes: list[int] = []

    def counted_walk(walk: Any) -> Any:
        def wrapped(ordered: list[float], limits: list[float], **options: Any) -> list[float | None]:
            sizes.append(len(ordered) + len(limits))
            found = walk(_counting(ordered), _counting(limits), **options)
            return [None if x is None else float(x) for x in found]
        return wrapped

    for restarts in (1000, 4000):
        args = soak(restarts, random.Random(restarts), noise=True)
        rows = sum(len(rows) for rows in args[2:])
        expected = repr(goodput.breakdown(*args))
        sizes.clear()
        with patch.multiple(goodput, _last_at_most_each=counted_walk(goodput._last_at_most_each),
                            _first_after_each=counted_walk(goodput._first_after_each)):
            compared = _compared(lambda args=args: goodput.breakdown(*args))
            assert repr(goodput.breakdown(*args)) == expected
        assert len(sizes) <= 10 and sum(sizes) <= 4 * rows, (restarts, len(sizes), sum(sizes), rows)
        assert 0 < compared <= 2 * sum(sizes), (restarts, compared, sum(sizes))


def _reference_last(ordered: list[float], limit: float) -> float | None:
    return max((x for x in ordered if x <= limit), default=None)


def _reference_first(ordered: list[float], limit: float, strict: bool) -> float | None:
    return next((x for x in ordered if (x > limit if strict else x >= limit)), None)


VALUE = st.one_of(st.integers(-3, 3).map(lambda x: x / 2), st.sampled_from([0.0, -0.0, math.inf, -math.inf]))


@given(parts=st.lists(st.lists(st.one_of(VALUE, st.just(math.nan)), max_size=12), min_size=1, max_size=3),
       limits=st.lists(st.one_of(VALUE, st.just(math.nan)), max_size=12), strict=st.booleans())
def test_walks_answer_as_max_and_next_in_order_or_not(parts: list[list[float]], limits: list[float],
                                                      strict: bool) -> None:
    """Parts and limits out of order (a clock that went back) are sorted once; -0.0 and 0.0 tell which of equal
    values is answered (the first, as max() and a stable sort give)."""
    ordered = goodput._ordered(*parts)
    assert repr(ordered) == repr(sorted(v for part in parts for v in part if not math.isnan(v)))
    assert repr(goodput._last_at_most_each(ordered, limits)) == repr([_reference_last(ordered, x) for x in limits])
    assert repr(goodput._first_after_each(ordered, limits, strict=strict)) == repr(
        [_reference_first(ordered, x, strict) for x in limits])
