"""A profile's variant with what serving adds to a decode step priced as profiles did before the
step log: the streams' median TPOT less the step line's decode step of as many streams (their
context the prompt + 24, all but the prompt's last 16 tokens shared), fitted as fixed + per
sequence. For plan_refit.py to set it beside the profile itself on the same runs.

    python benchmarks/plan_serving_tpot.py PROFILE.json OUT.json

The profile must keep its streams' TPOTs (`tpot_samples`, written since the step log). Everything
but the serving figures is copied as it is, so runs measured on PROFILE.json check against OUT.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.plan import profile_file  # noqa: E402
from pdserve.plan.profile import STREAM_PROMPT, _line  # noqa: E402
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


def main() -> int:
    source, out = sys.argv[1], Path(sys.argv[2])
    prof = profile_file.load(source)
    if "tpot_samples" not in prof["serving"]:
        sys.exit(f"{source} keeps no streams' TPOTs (profiled before the step log)")
    prof["serving"] = tpot_priced(prof["serving"], prof["engines"]["1"])
    for threads, serving in prof["colocated_serving"].items():
        prof["colocated_serving"][threads] = tpot_priced(serving, prof["engines"][threads])
    for name in ("serving", *(f"colocated {t}" for t in prof["colocated_serving"])):
        fig = prof["serving"] if name == "serving" else prof["colocated_serving"][name.split()[1]]
        print(f"{name}: {fig['fixed_s'] * 1e3:.1f} ms + {fig['per_sequence_s'] * 1e3:.2f} ms a sequence")
    profile_file.write(prof, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
