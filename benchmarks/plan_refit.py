"""The simulator's errors against measured runs, with the profile's step lines as fitted and fitted
again without the distinct-context term (step_model.py), without it and the distinct decode
samples (profile.DISTINCT_GRID: steps whose sequences share no block), and without the decode
samples of sequences sharing a long prefix (where the profile has them): what each changes, on
the same runs.

    python benchmarks/plan_refit.py --profile PROFILE.json RUN.json ... [--json OUT.json]

The runs must have been measured against this profile's predictions (plan_accuracy.py --profile);
each cell's error is against the median of the runs' measurements. This script only simulates.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plan_accuracy import DEPLOYMENTS, FIGURES, GOAL, WORKLOADS, error, rows_of, runs_on, workload  # noqa: E402

from pdserve.plan import profile_file  # noqa: E402
from pdserve.plan.profile import DECODE_GRID, DISTINCT_GRID, provenance  # noqa: E402
from pdserve.plan.simulator import SPREAD, simulate  # noqa: E402
from pdserve.plan.step_model import Step, StepModel  # noqa: E402


def of_grid(sample: dict, grid: list[tuple[int, int]]) -> bool:
    """A decode sample of one of the grid's (batch, context) shapes (its contexts a few tokens past
    the grid's, as the step decodes)."""
    d = sample["decodes"]
    return not sample["prefills"] and any(len(d) == b and all(c <= n < c + 16 for n in d) for b, c in grid)


def distinct(sample: dict) -> bool:
    """A decode sample of DISTINCT_GRID's shape sharing no block (the shared grid has (4, 1024)
    too, since 2026-11-28)."""
    return of_grid(sample, DISTINCT_GRID) and not sample.get("shared", 0)


def long_shared(sample: dict) -> bool:
    """A decode sample of several sequences sharing a prefix of ~1,000 tokens (DECODE_GRID's
    shapes of 1,024 tokens and more sequences than one, added after the paired set)."""
    return of_grid(sample, [(b, c) for b, c in DECODE_GRID if c >= 1024 and b > 1]) and sample.get("shared", 0) > 0


def refitted(prof: dict, keep, distinct_term: bool = True) -> dict:
    """The profile with each engine's step line fitted again on the samples `keep` accepts (without
    the distinct-context term: every sample's shared tokens taken as 0)."""
    out = copy.deepcopy(prof)
    for eng in out["engines"].values():
        kept = [s for s in eng["samples"] if keep(s)]
        steps = [
            Step([tuple(p) for p in s["prefills"]], s["decodes"], s["shared"] if distinct_term else 0) for s in kept
        ]
        eng["step"] = StepModel.fit(list(zip(steps, [s["seconds"] for s in kept]))).to_dict()
    return out


def fits(prof: dict) -> dict:
    """{name: profile}: as fitted; without the distinct term (where the samples record their shared
    tokens: profiles from e98848c on); without the samples sharing a long prefix (where there are
    some); without the distinct term and the distinct samples."""
    samples = [s for eng in prof["engines"].values() for s in eng["samples"]]
    if not any(distinct(s) for s in samples):
        raise SystemExit("the profile has no distinct decode samples: nothing to compare")
    out = {"as_fitted": prof}
    if all("shared" in s for s in samples):
        out["without_distinct_term"] = refitted(prof, lambda s: True, distinct_term=False)
    if any(long_shared(s) for s in samples):
        out["without_long_shared"] = refitted(prof, lambda s: not long_shared(s))
    return out | {"without_distinct": refitted(prof, lambda s: not distinct(s), distinct_term=False)}


def errors(prof: dict, runs: list[dict]) -> dict:
    cells = {}
    for w, slo in WORKLOADS.items():
        for d, dep in DEPLOYMENTS.items():
            rows = rows_of(runs, w, d)
            if not rows:
                continue
            report = simulate(prof, dep, workload(w, rows[0].get("trace")), *slo)
            cell = {}
            for f in FIGURES:
                measured = statistics.median(r[f]["measured"] for r in rows)
                predicted = SPREAD[f](report)
                cell[f] = {"predicted": predicted, "measured": measured, "error": error(predicted, measured)}
            cell["within"] = all(cell[f]["error"] <= GOAL for f in FIGURES)
            cells[f"{w}/{d}"] = cell
    return cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="plan_accuracy.json files measured on this profile")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    began = time.monotonic()
    prof = profile_file.load(args.profile)
    runs = runs_on(prof, args.profile, args.runs, ap)
    results = {name: errors(p, runs) for name, p in fits(prof).items()}
    for name, cells in results.items():
        for key, cell in cells.items():
            figures = "  ".join(
                f"{f} {cell[f]['predicted']:.3g}/{cell[f]['measured']:.3g} ({cell[f]['error']:.0%})" for f in FIGURES
            )
            print(f"{name:21s} {key:20s} {figures}" + ("  within" if cell["within"] else ""))
        print(
            f"{name}: {sum(c['within'] for c in cells.values())} of {len(cells)} cells within {GOAL:.0%} on all three"
        )
    if args.json:
        result = {**provenance(prof, began), "profile_file": args.profile, "runs": [str(p) for p in args.runs]}
        args.json.write_text(json.dumps(result | results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
