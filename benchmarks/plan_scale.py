"""Where xPyD beats colocated, predicted from a measured profile (DistServe's methodology): for each
budget of cores (of GPUs, from a GPU's profile), every deployment that uses all of it, the highest
Poisson arrival rate at which 90% of requests meet both SLOs, per core (per GPU).

    python benchmarks/plan_scale.py --profile docs/bench/plan_profile.json [--budgets 2,4,8,16]

Workload: the anchor's requests (590-630 prompt tokens, 64 output tokens), 120 per run (--requests), Poisson
arrivals. SLOs are scales of what one request alone costs on one engine of one thread (DistServe
scales its SLOs the same way): TTFT within --ttft-scale x its prefill, TPOT within --tpot-scale x
a decode step of one sequence. Deployments: `pdserve plan best`'s candidates that spend the whole
budget (k colocated engines; P prefill + D decode nodes with local prefill off, or auto at each of
its local-token caps and shares of prompt tokens beside decodes; engines of each profiled thread
count, or one GPU each), the KV handed over what --kv-transport auto takes on one host (shared
memory; TCP for a KV on a GPU) or --transport.

A prediction, not a measurement: it assumes each engine's cores run as they did when profiled
(no memory-bandwidth or cache contention between engines, which a real many-core host has), that
the router never bottlenecks, and the KV fits (no preemption).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.plan import profile as profiles  # noqa: E402
from pdserve.plan import profile_file, search  # noqa: E402
from pdserve.plan.simulator import Deployment, simulate, synthetic  # noqa: E402
from pdserve.plan.step_model import Step, StepModel  # noqa: E402

ATTAINMENT = 0.9
REQUESTS = 120


def full_budget(budget: int, prof: dict, transport: str) -> list[Deployment]:
    """`pdserve plan best`'s candidates that spend the whole budget."""
    threads = sorted(int(t) for t in prof["engines"])
    return [d for d in search.candidates(budget, threads, transport, search.on_gpu(prof)) if d.spends == budget]


def max_rate(prof: dict, dep: Deployment, slo: tuple[float, float], requests: int, seed: int = 0) -> float:
    """The highest rate (requests/s) with >= 90% of requests within both SLOs (bisection)."""

    def attained(rate: float) -> bool:
        rep = simulate(prof, dep, synthetic(requests, "uniform:590:630", "64", seed, rate=rate), *slo)
        return rep.good_requests >= ATTAINMENT * rep.num_requests

    lo, hi = 0.0, 1.0
    while attained(hi):
        lo, hi = hi, hi * 2
        if hi > 1e4:
            return hi
    for _ in range(8):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if attained(mid) else (lo, mid)
    return lo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--budgets", default="2,4,8,16", help="cores (GPUs for a GPU's profile)")
    ap.add_argument("--ttft-scale", type=float, default=4.0)
    ap.add_argument("--tpot-scale", default="1.5,3", help="comma-separated: one sweep each")
    ap.add_argument("--transport", default=None, help="default: what --kv-transport auto takes on one host")
    ap.add_argument(
        "--requests",
        type=int,
        default=REQUESTS,
        help="requests per simulated run (a GPU's rates need more: 120 arrive within a second there, a burst, "
        "not a steady load)",
    )
    ap.add_argument("--json", type=Path, default=Path("docs/bench/plan_scale.json"))
    args = ap.parse_args()
    prof = profile_file.load(args.profile)
    transport, unit = args.transport or search.default_transport(prof), "gpu" if search.on_gpu(prof) else "core"
    one = StepModel(**prof["engines"]["1"]["step"])
    prefill_s, step_s = one.seconds(Step([(610, 0)], [])), one.seconds(Step([], [610]))
    began, rows = time.monotonic(), []
    for tpot_scale in (float(x) for x in args.tpot_scale.split(",")):
        slo = (args.ttft_scale * prefill_s, tpot_scale * step_s)
        for budget in (int(c) for c in args.budgets.split(",")):
            deployments = full_budget(budget, prof, transport)
            if all(d.colocated for d in deployments):
                raise SystemExit(f"--budgets: {budget} {unit}(s) hold no prefill and decode node pair")
            rates = {dep: max_rate(prof, dep, slo, args.requests) for dep in deployments}
            colocated = max((d for d in rates if d.colocated), key=rates.get)
            disagg = max((d for d in rates if not d.colocated), key=rates.get)
            row = {
                "budget": budget,
                "unit": unit,
                "slo_ttft_s": slo[0],
                "slo_tpot_s": slo[1],
                "tpot_scale": tpot_scale,
                "best_colocated": colocated.describe(),
                "colocated_rps_per_unit": rates[colocated] / budget,
                "best_disaggregated": disagg.describe(),
                "disaggregated_rps_per_unit": rates[disagg] / budget,
                "ratio": rates[disagg] / rates[colocated] if rates[colocated] else None,
                "deployments": len(rates),
            }
            rows.append(row)
            print(
                f"TPOT <= {slo[1] * 1e3:.0f} ms, {budget:2d} {unit}s: "
                f"colocated {row['colocated_rps_per_unit']:.3f} req/s/{unit} ({row['best_colocated']}), "
                f"xPyD {row['disaggregated_rps_per_unit']:.3f} ({row['best_disaggregated']}), ratio {row['ratio']:.2f}",
                flush=True,
            )
    result = {
        **profiles.provenance(prof, began),
        "requests": args.requests,
        "transport": transport,
        "attainment": ATTAINMENT,
        "rows": rows,
    }
    args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
