"""How much the measured side of `plan_accuracy.py` moves between windows: per cell (workload,
deployment) and figure, each set's median (a set: the runs of one profile, minutes apart) and how
far the sets' medians lie apart (the largest over the smallest, less one), beside how far the runs
of one set lie apart. Only measurements are read: the predictions and profiles play no part.
Two medians whose ratio exceeds (1 + GOAL) / (1 - GOAL) (1.35: more than 35% apart) have no
prediction within GOAL of both (plan_accuracy.error: |predicted - measured| / measured).

    python benchmarks/plan_windows.py --set NAME RUN.json ... --set NAME RUN.json ... [--json OUT.json]
        [--waves anchor/1P1D-off]

--waves also prints, for one cell, each run's prefill batches as its records show them: the sizes
of the groups of requests whose first tokens came each within WAVE_S of the one before, in order
(a closed loop settles into a pattern of such waves; the simulator's prediction, the run's
"predicted" records, is shown beside). WAVE_S suits the anchor's ~1 s prefill steps, not chat's.

Give sets measured by the same serving code on one machine class. A cell measured in fewer than
two sets has no row (it is named at the end); a set of one run shows no spread of its runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plan_accuracy import DEPLOYMENTS, FIGURES, GOAL, WORKLOADS, rows_of  # noqa: E402

WAVE_S = 0.15  # first tokens this close came out of one prefill step (steps of 610-token prompts take ~1 s)
NO_COMMON_PREDICTION = (1 + GOAL) / (1 - GOAL) - 1  # two medians further apart than this: none within GOAL of both


def apart(values: list[float]) -> float:
    """The largest over the smallest, less one (infinite where the smallest is 0)."""
    return max(values) / min(values) - 1 if min(values) > 0 else float("inf")


def cells(sets: dict[str, list[dict]]) -> tuple[dict, list[str]]:
    """({cell: figures} for the cells measured in two sets or more, the cells in one set only)."""
    out, alone = {}, []
    for key in (f"{w}/{d}" for w in WORKLOADS for d in DEPLOYMENTS):
        per_set = {}
        for name, runs in sets.items():
            if rows := rows_of(runs, *key.split("/")):
                per_set[name] = {f: [r[f]["measured"] for r in rows] for f in FIGURES}
        if len(per_set) == 1:
            alone.append(key)
        if len(per_set) < 2:
            continue
        cell = {}
        for f in FIGURES:
            medians = {name: statistics.median(v[f]) for name, v in per_set.items()}
            runs_apart = [apart(v[f]) for v in per_set.values() if len(v[f]) > 1]
            cell[f] = {
                "set_medians": medians,
                "between_sets": apart(list(medians.values())),
                "within_set_max": max(runs_apart) if runs_apart else None,
            }
        cell["no_common_prediction"] = [f for f in FIGURES if cell[f]["between_sets"] > NO_COMMON_PREDICTION]
        out[key] = cell
    return out, alone


def waves(records: list[dict]) -> list[int]:
    groups: list[list[float]] = []
    for t in sorted(r["first_token"] for r in records if r["first_token"] is not None):
        if groups and t - groups[-1][-1] < WAVE_S:
            groups[-1].append(t)
        else:
            groups.append([t])
    return [len(g) for g in groups]


def run_waves(sets: dict[str, list[dict]], key: str) -> dict:
    """{set: [{measured, predicted: waves, tpot_p50_s}, ...]} of the runs that kept their records."""
    out = {}
    for name, runs in sets.items():
        rows = [r for r in rows_of(runs, *key.split("/")) if "records" in r]
        out[name] = [
            {side: waves(r["records"][side]) for side in ("measured", "predicted")} | {"tpot_p50_s": r["tpot_p50_s"]}
            for r in rows
        ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", nargs="+", action="append", required=True, metavar=("NAME", "RUN"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--waves", metavar="WORKLOAD/DEPLOYMENT", help="each run's prefill batches in this cell")
    args = ap.parse_args()
    sets = {}
    for name, *paths in args.set:
        if not paths:
            ap.error(f"--set {name}: give its plan_accuracy.json files after the name")
        if name in sets:
            ap.error(f"--set {name} is given twice")
        sets[name] = [json.loads(Path(p).read_text()) for p in paths]
    if args.waves and not any(rows_of(runs, *args.waves.partition("/")[::2]) for runs in sets.values()):
        ap.error(f"--waves {args.waves}: no set measured that cell")
    result, alone = cells(sets)
    for key, cell in result.items():
        figures = "  ".join(
            f"{f} {min(cell[f]['set_medians'].values()):.3g}-{max(cell[f]['set_medians'].values()):.3g}"
            f" ({cell[f]['between_sets']:.0%}; runs of a set up to "
            + ("-" if cell[f]["within_set_max"] is None else f"{cell[f]['within_set_max']:.0%}")
            + ")"
            for f in FIGURES
        )
        print(f"{key:22s} {figures}")
    wide = sum(bool(c["no_common_prediction"]) for c in result.values())
    print(
        f"{wide} of {len(result)} cells with two sets' medians more than {NO_COMMON_PREDICTION:.0%} apart"
        f" on some figure: no prediction is within {GOAL:.0%} of both"
        + (f" (measured in one set only: {', '.join(alone)})" if alone else "")
    )
    out = {"sets": {name: paths for name, *paths in args.set}, "goal": GOAL, "cells": result, "one_set_only": alone}
    if args.waves:
        out["waves"] = {args.waves: run_waves(sets, args.waves)}
        for name, rows in out["waves"][args.waves].items():
            for r in rows:
                tpot = r["tpot_p50_s"]
                print(
                    f"{args.waves} {name}: measured {r['measured']} (TPOT p50 {tpot['measured'] * 1e3:.0f} ms),"
                    f" predicted {r['predicted']} ({tpot['predicted'] * 1e3:.0f} ms)"
                )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
