"""The simulator against measured runs over repeats: per cell (workload, deployment), the median of
the measured values of several `plan_accuracy.py` runs against the median of their predictions.

    python benchmarks/plan_accuracy_medians.py RUN.json RUN.json ... [--replaced-by RUN.json ...] [--json OUT.json]

Each run draws its own prompts (its seed), so the predictions move a little between runs and the
measurements move more; one run per cell cannot tell the simulator's error from the machine's
run-to-run noise. Also shown: the spread of the measured values (max/min - 1) per cell. Runs after
--replaced-by (a change re-measured on the cells it moves) take the place of the cells they measure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

METRICS = ("goodput_tps", "ttft_p50_s", "tpot_p50_s")
GOAL = 0.15  # the bound on the relative error


def cells(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    by: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        for row in run["rows"]:
            by.setdefault((row["workload"], row["deployment"]), []).append(row)
    return by


def summarize(rows: list[dict]) -> dict:
    out = {"runs": len(rows)}
    for m in METRICS:
        pred = statistics.median(r[m]["predicted"] for r in rows)
        meas = [r[m]["measured"] for r in rows]
        med = statistics.median(meas)
        out[m] = {
            "predicted_median": pred,
            "measured_median": med,
            "error": abs(pred - med) / med if med else None,
            "measured_spread": max(meas) / min(meas) - 1 if min(meas) > 0 else None,
        }
    out["within_goal"] = all(out[m]["error"] is not None and out[m]["error"] <= GOAL for m in METRICS)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--replaced-by", nargs="+", type=Path, default=[], help="runs whose cells replace the runs' cells")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    by_cell = cells([json.loads(p.read_text()) for p in args.runs])
    by_cell.update(cells([json.loads(p.read_text()) for p in args.replaced_by]))
    table = {f"{w}/{d}": summarize(rows) for (w, d), rows in by_cell.items()}
    for name, s in table.items():
        parts = [
            f"{m} {s[m]['predicted_median']:.3g}/{s[m]['measured_median']:.3g} ({s[m]['error']:.0%}, "
            f"spread {s[m]['measured_spread']:.0%})"
            for m in METRICS
        ]
        print(f"{name:24s} {s['runs']} runs  " + "  ".join(parts) + ("  within 15%" if s["within_goal"] else ""))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "runs": [str(p) for p in args.runs],
                    "replaced_by": [str(p) for p in args.replaced_by],
                    "cells": table,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
