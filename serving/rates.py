"""Per-second rates of a replica's running totals, for its autoscaling stats.

Serve reads a replica's `record_autoscaling_stats()` every `metrics_interval_s` and averages the
readings over `look_back_period_s`; a rate here is the change of each total since the previous
reading over the time between them, so the average Serve takes is the rate over its window.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Rates:
    def __init__(self, totals: dict[str, Callable[[], float]], clock: Callable[[], float] = time.monotonic):
        self.totals, self.clock = totals, clock
        self.last = (clock(), {name: float(read()) for name, read in totals.items()})

    def read(self) -> dict[str, float]:
        """{name: change per second since the previous read} (0 for a first read at once)."""
        now, values = self.clock(), {name: float(read()) for name, read in self.totals.items()}
        then, before = self.last
        self.last = (now, values)
        dt = now - then
        return {name: (values[name] - before[name]) / dt if dt > 0 else 0.0 for name in values}
