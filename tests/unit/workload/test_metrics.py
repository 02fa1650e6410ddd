"""metrics.jsonl lines: the same keys for both engines, the megatron engine's phase timings only when given."""

from __future__ import annotations

import json
from pathlib import Path

from metrics import METRIC_KEYS, RankFiles  # tests/unit/workload/conftest.py puts the workload directory on sys.path


def test_every_line_has_the_common_keys_and_optional_ones_only_when_given(tmp_path: Path) -> None:
    files = RankFiles(tmp_path, 0)
    files.record({"iteration": 1, "loss": 2.5, "forward_backward_s": 0.5, "optimizer_s": 0.1, "profiled": True,
                  "unknown": 7})
    files.record({"iteration": 2, "loss": 2.4})
    first, second = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert set(METRIC_KEYS) <= set(first) and set(METRIC_KEYS) == set(second)
    assert (first["forward_backward_s"], first["optimizer_s"], first["profiled"]) == (0.5, 0.1, True)
    assert "unknown" not in first and first["grad_norm"] is None and second["loss"] == 2.4
