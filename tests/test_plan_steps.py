"""benchmarks/plan_steps.py: what the other engines ran beside a served step."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from plan_steps import beside  # noqa: E402


def _step(t: float, s: float) -> dict:
    return {"t": t, "s": s}


def test_a_step_is_beside_what_the_other_engines_ran_over_most_of_it():
    decoding, prefilling = (0.0, 0.06, "decode"), (0.13, 0.5, "prefill")
    assert beside(_step(0.01, 0.04), [decoding, prefilling]) == "decoding"  # 0.04 of 0.04 beside a decode
    assert beside(_step(0.11, 0.05), [decoding, prefilling]) == "prefilling"  # 0.03 of 0.05 beside a prefill
    assert beside(_step(0.05, 0.08), [decoding, prefilling]) == "idle"  # 0.01 beside a decode, 0.07 of 0.08 not
    assert beside(_step(0.6, 0.04), [decoding, prefilling]) == "idle"
    assert beside(_step(0.01, 0.04), [(0.0, 0.03, "mixed"), (0.03, 0.05, "decode")]) == "decoding"  # both decode
    assert beside(_step(0.01, 0.04), []) == "idle"
