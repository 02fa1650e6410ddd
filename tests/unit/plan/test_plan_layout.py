"""Layout parsing and pipeline stage splits."""

from __future__ import annotations

import pytest

from stepdeploy.errors import BadInput
from stepdeploy.plan.layout import Layout, parse_layout, stage_layer_counts


def test_parse_layout_reads_numbers_words_and_aliases() -> None:
    layout = parse_layout("tp=8, pp=2, ep=4, recompute=full, dist-opt=off, mbs=2")
    assert layout == Layout(tp=8, pp=2, ep=4, recompute="full", distributed_optimizer=False, mbs=2)
    assert Layout().rope_fusion and parse_layout("rope-fusion=off") == Layout(rope_fusion=False)


@pytest.mark.parametrize(
    "text,words",
    [
        ("tq=8", "keys: tp"),
        ("tp=0", "positive integer"),
        ("recompute=most", "none, selective, full"),
        ("tp", "key=value"),
    ],
)
def test_parse_layout_errors_say_what_is_valid(text: str, words: str) -> None:
    with pytest.raises(BadInput, match=words):
        parse_layout(text)


@pytest.mark.parametrize(
    "pp,counts",
    [(1, (45,)), (2, (22, 23)), (3, (15, 15, 15)), (4, (10, 12, 12, 11)), (8, (4, 6, 6, 6, 6, 6, 6, 5))],
)
def test_45_layers_split_with_lighter_first_and_last_stages(pp: int, counts: tuple[int, ...]) -> None:
    assert stage_layer_counts(45, Layout(pp=pp)) == counts
    assert sum(counts) == 45


def test_explicit_first_and_last_stage_sizes() -> None:
    assert stage_layer_counts(45, Layout(pp=4, first_stage_layers=9, last_stage_layers=12)) == (9, 12, 12, 12)
    assert stage_layer_counts(45, Layout(pp=4, first_stage_layers=10, last_stage_layers=10)) is None
