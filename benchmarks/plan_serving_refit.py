"""A profile's serving figures (what serving adds to a decode step) fitted again from the samples
the profile keeps, everything else copied as it is, so that runs measured on the profile check
against the result too (plan_refit.py, plan_steps.py):

    python benchmarks/plan_serving_refit.py PROFILE.json OUT.json --priced-by steps|line|tpot

steps: the served decode steps as this pdserve's `profile.serving_overhead` prices them (a
profile written by an earlier fit refitted; since the reference steps, each over the line less
what the unserved steps of the nearest batch size, in its window, took over it). line: the
served steps over the step line alone, as profiles priced serving before the reference steps
(`line_samples`). tpot: as profiles priced serving before the step log, the streams' median
TPOT less the step line's decode step of as many streams (their context the prompt + 24, all but
its last 16 tokens shared), fitted as fixed + per sequence; the profile must keep its streams'
TPOTs (`tpot_samples`, written since the step log).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.plan import profile_file  # noqa: E402
from pdserve.plan.profile import STREAM_PROMPT, _line, _over_line, less_drift, serving_fit  # noqa: E402
from pdserve.plan.step_model import Step, StepModel  # noqa: E402


def tpot_priced(serving: dict, engine: dict) -> dict:
    step, block_size = StepModel(**engine["step"]), engine["block_size"]
    context, prefix = STREAM_PROMPT + 24, (STREAM_PROMPT - 16) // block_size * block_size
    extra = [
        (batch, max(0.0, tpot - step.seconds(Step([], [context] * batch, (batch - 1) * prefix))))
        for batch, tpot in serving["tpot_samples"]
    ]
    line = _line(extra)
    return {"fixed_s": line["fixed_s"], "per_sequence_s": line["per_token_s"], "samples": extra}


def refit(serving: dict, engine: dict, priced_by: str) -> dict:
    if priced_by == "tpot":
        return tpot_priced(serving, engine)
    kept = {k: serving[k] for k in ("tpot_samples", "line_samples", "reference") if k in serving}
    if "line_samples" not in serving:  # (profiled before the reference steps)
        return serving_fit([tuple(x) for x in serving["samples"]]) | kept
    over = [tuple(x) for x in serving["line_samples"]]
    if priced_by == "steps":  # as the code now prices it
        over = less_drift(over, _over_line(serving["reference"], StepModel(**engine["step"])))
    return serving_fit(over) | kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("out", type=Path)
    ap.add_argument("--priced-by", choices=("steps", "line", "tpot"), required=True)
    args = ap.parse_args()
    prof = profile_file.load(args.profile)
    if "tpot_samples" not in prof["serving"]:
        ap.error(f"{args.profile} keeps no streams' TPOTs (profiled before the step log)")
    if args.priced_by == "line" and "line_samples" not in prof["serving"]:
        ap.error(f"{args.profile} keeps no served steps over the line alone (profiled before the reference steps)")
    prof["serving"] = refit(prof["serving"], prof["engines"]["1"], args.priced_by)
    for threads, serving in prof["colocated_serving"].items():
        prof["colocated_serving"][threads] = refit(serving, prof["engines"][threads], args.priced_by)
    figures = {"nodes": prof["serving"]} | {f"colocated x {t}": f for t, f in prof["colocated_serving"].items()}
    for name, fig in figures.items():
        print(f"{name}: {fig['fixed_s'] * 1e3:.1f} ms + {fig['per_sequence_s'] * 1e3:.2f} ms a sequence")
    profile_file.write(prof, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
