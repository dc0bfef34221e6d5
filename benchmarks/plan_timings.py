"""The simulator's predictions over arrival timings against measured runs: per cell (workload,
deployment) of `plan_accuracy.py` runs, the prediction with arrivals on time (the one those runs
recorded), the median and range over --seeds timing seeds (simulator.py: arrivals late by up to
ARRIVAL_JITTER_S), and each run's measurement, in or out of that range.

    python benchmarks/plan_timings.py --profile PROFILE.json RUN.json ... [--seeds 21] [--json OUT.json]

The runs must have been measured against this profile's predictions (their plan_accuracy.py
--profile; checked against what each run recorded of its profile); this script only simulates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plan_accuracy import DEPLOYMENTS, FIGURES, WORKLOADS, error, rows_of, runs_on, workload  # noqa: E402

from pdserve.plan import profile_file  # noqa: E402
from pdserve.plan.profile import provenance  # noqa: E402
from pdserve.plan.simulator import simulate, timing_spread  # noqa: E402


def cell(prof: dict, wname: str, dname: str, rows: list[dict], seeds: int) -> dict:
    work = workload(wname, rows[0].get("trace"))
    dep, slo = DEPLOYMENTS[dname], WORKLOADS[wname]
    spread = timing_spread([simulate(prof, dep, work, *slo, timing_seed=s) for s in range(seeds)])
    out = {}
    for f in FIGURES:
        measured = [r[f]["measured"] for r in rows]
        on_time = statistics.median(r[f]["predicted"] for r in rows)  # as the runs recorded it (one profile)
        lo, hi, med = spread[f]["min"], spread[f]["max"], statistics.median(measured)
        out[f] = {
            "measured": measured,
            "measured_median": med,
            "on_time": on_time,
            "on_time_error": error(on_time, med),
            "timings": spread[f],
            "timings_error": error(spread[f]["median"], med),
            "runs_in_range": sum(lo <= m <= hi for m in measured),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="plan_accuracy.json files measured on this profile")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--seeds", type=int, default=21)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    began = time.monotonic()
    prof = profile_file.load(args.profile)
    runs = runs_on(prof, args.profile, args.runs, ap)
    keys = [(r["workload"], r["deployment"]) for r in runs[0]["rows"]]
    cells = {}
    for w, d in keys:
        rows = rows_of(runs, w, d)
        c = cells[f"{w}/{d}"] = cell(prof, w, d, rows, args.seeds)
        print(
            f"{w:7s} {d:13s} "
            + "  ".join(
                f"{f} {c[f]['on_time']:.3g} ({c[f]['on_time_error']:.0%}) | "
                f"{c[f]['timings']['median']:.3g} ({c[f]['timings_error']:.0%}) "
                f"[{c[f]['timings']['min']:.3g}-{c[f]['timings']['max']:.3g}] {c[f]['runs_in_range']}/{len(rows)} in"
                for f in FIGURES
            ),
            flush=True,
        )
    if args.json:
        result = {
            **provenance(prof, began),
            "profile_file": args.profile,
            "runs": [str(p) for p in args.runs],
            "seeds": args.seeds,
            "cells": cells,
        }
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
