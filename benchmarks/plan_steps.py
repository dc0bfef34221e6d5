"""Served engine steps beside the simulator's price of each: runs of plan_accuracy.py --step-log
(each engine's steps as engine/step_log.py writes them), priced by the simulator's own
Engine.step_seconds on the profile the runs were measured on.

    python benchmarks/plan_steps.py --profile docs/bench/PROFILE.json docs/bench/plan_accuracy_*.json \
        [--json docs/bench/plan_steps.json]

Per cell and kind of step (decode: decodes only; prefill: prefill chunks only; mixed: both): the
steps' count, the median of measured / priced, the sum of measured over the sum priced, and the
same against the step line alone (without what serving adds, sampling at the run's temperature, or
the profile's contention figure on a decode step beside another engine's decoding);
for decode steps, per batch size, and (deployments of two or more engines) by what the other
engines ran over most of the step: decoding (a step with decodes), prefilling (prefill chunks only)
or idle. Runs at another temperature are cells of their own.
Gap: the median time between one step's end and the next's start on the same engine, where the
next starts within 50 ms (a busy engine; longer gaps are waits for work), which the simulator
prices as nothing of its own (what serving adds is measured from TPOT, so it holds the gaps).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plan_accuracy import DEPLOYMENTS, WORKLOADS, runs_on  # noqa: E402

from pdserve.plan import profile_file  # noqa: E402
from pdserve.plan.simulator import Simulation  # noqa: E402
from pdserve.plan.step_model import Step  # noqa: E402

BUSY_GAP_S = 0.05
BATCHES = ((1, 2), (3, 4), (5, 8), (9, 16), (17, 1 << 30))


def kind(step: dict) -> str:
    return "mixed" if step["prefills"] and step["decodes"] else "prefill" if step["prefills"] else "decode"


def beside(step: dict, others: list[tuple[float, float, str]]) -> str:
    """What the other engines ran over most of a step (others: their steps' (start, end, kind)):
    "decoding", "prefilling", or "idle" (under half of the step beside any)."""
    start, end = step["t"], step["t"] + step["s"]
    overlap = defaultdict(float)
    for a, b, k in others:
        overlap["prefilling" if k == "prefill" else "decoding"] += max(0.0, min(end, b) - max(start, a))
    busiest = max(overlap, key=overlap.get, default="idle")
    return busiest if overlap.get(busiest, 0.0) > step["s"] / 2 else "idle"


def summary(rows: list[tuple[float, float, float]]) -> dict:
    """rows: (measured, priced, line) seconds."""
    return {
        "steps": len(rows),
        "measured_ms": statistics.median(m for m, _, _ in rows) * 1e3,
        "over_priced": statistics.median(m / p for m, p, _ in rows),
        "sum_over_priced": sum(m for m, _, _ in rows) / sum(p for _, p, _ in rows),
        "over_line": statistics.median(m / line for m, _, line in rows),
    }


def cell(prof: dict, workload: str, deployment: str, temperature: float, steps: list[dict]) -> dict:
    sim = Simulation(prof, DEPLOYMENTS[deployment], *WORKLOADS[workload])
    sim.sample_at(temperature)  # (the run's requests': plan_accuracy.py --temperature)
    by_pid = defaultdict(list)
    for s in steps:
        by_pid[s["pid"]].append(s)
    kinds, batches, neighbours, gaps = defaultdict(list), defaultdict(list), defaultdict(list), []
    # a prefill node's engine never decodes; its served share grows with the streams decoding
    # elsewhere: those of the latest decode step begun on any other engine
    decoding = sorted((s["t"], len(s["decodes"])) for s in steps if s["decodes"])
    for engine_steps in by_pid.values():
        prefill_node = sim.prefills and not any(s["decodes"] for s in engine_steps)
        engine = sim.prefills[0] if prefill_node else sim.decodes[0]
        engine_steps.sort(key=lambda s: s["t"])
        others = [(s["t"], s["t"] + s["s"], kind(s)) for s in steps if s["pid"] != engine_steps[0]["pid"]]
        for s, after in zip(engine_steps, engine_steps[1:] + [None]):
            step = Step([tuple(p) for p in s["prefills"]], s["decodes"], s["shared"])
            before = bisect.bisect(decoding, (s["t"], 1 << 30))
            streams = decoding[before - 1][1] if before else 0
            state = beside(s, others) if len(by_pid) > 1 else None
            contended = state == "decoding" and kind(s) == "decode"  # (the simulator asks at its start)
            row = (s["s"], engine.step_seconds(step, s["ending"], streams, contended), engine.model.seconds(step))
            kinds[kind(s)].append(row)
            if kind(s) == "decode":
                batches[next(f"{lo}-{min(hi, 99)}" for lo, hi in BATCHES if lo <= len(s["decodes"]) <= hi)].append(row)
                if state:
                    neighbours[state].append(row)
                if after is not None and 0 <= after["t"] - s["t"] - s["s"] < BUSY_GAP_S:
                    gaps.append(after["t"] - s["t"] - s["s"])
    return {
        "workload": workload,
        "deployment": deployment,
        "temperature": temperature,
        "kinds": {k: summary(v) for k, v in sorted(kinds.items())},
        "decode_batches": {b: summary(v) for b, v in batches.items()},
        "decode_beside": {n: summary(v) for n, v in sorted(neighbours.items())},
        "busy_gap_ms": statistics.median(gaps) * 1e3 if gaps else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="the profile the runs were measured on")
    ap.add_argument("runs", nargs="+", type=Path, help="plan_accuracy.py --step-log outputs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    prof = profile_file.load(args.profile)
    cells = defaultdict(list)
    for run in runs_on(prof, args.profile, args.runs, ap):
        for row in run["rows"]:
            cells[row["workload"], row["deployment"], run.get("temperature", 0.0)] += row.get("steps", [])
    if not any(cells.values()):
        ap.error("no run kept its steps (plan_accuracy.py --step-log)")
    out = [cell(prof, *key, steps) for key, steps in cells.items() if steps]
    for c in out:
        at = f" at temperature {c['temperature']:g}" if c["temperature"] else ""
        print(f"{c['workload']} {c['deployment']}{at}: busy gap {c['busy_gap_ms'] or 0:.1f} ms")
        for name, k in [
            *c["kinds"].items(),
            *((f"  decode {b}", v) for b, v in c["decode_batches"].items()),
            *((f"  beside {n}", v) for n, v in c["decode_beside"].items()),
        ]:
            print(
                f"  {name:14s} {k['steps']:4d} steps, {k['measured_ms']:7.1f} ms; measured / priced "
                f"{k['over_priced']:.2f} (sums {k['sum_over_priced']:.2f}), / line {k['over_line']:.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "cells": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
