"""What an A-against-B benchmark reports, the same way each time: per-run figures, their medians,
each ratio as the median of the per-run ratios with the runs beside it (machines are noisy; a
ratio of medians is another figure), printed and written as JSON."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path


def median_of(runs: list[dict], value: Callable[[dict], float]) -> float:
    return statistics.median(value(r) for r in runs)


def ratio(runs: list[dict], num: Callable[[dict], float], den: Callable[[dict], float]) -> dict:
    per_run = [num(r) / den(r) for r in runs]
    return {"median_of_runs": statistics.median(per_run), "runs": per_run}


def emit(summary: dict, path: Path | None) -> None:
    text = json.dumps(summary, indent=2)
    print(text)
    if path:
        path.write_text(text + "\n")
