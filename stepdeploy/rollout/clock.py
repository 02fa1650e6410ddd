"""The controller's clock: what the soak's state machine reads the time from and sleeps on (rich's
`get_time=` habit). Real by default; a test passes a clock that jumps, so a 10-minute soak with restarts
runs in milliseconds (stepdeploy/testing.py)."""

from __future__ import annotations

import time as _time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    time: Callable[[], float] = _time.time
    sleep: Callable[[float], None] = _time.sleep


REAL = Clock()
