"""`pdserve plan`: every deployment a core budget allows, simulated on the workload; the best that
meets the SLOs, and the runner-up.

Candidates (threads per engine: the thread counts the profile measured): k colocated engines, and
P prefill + D decode nodes with the router's local prefill on (auto, at each local-token cap) or
off, using every core or fewer. A candidate meets the SLOs when its TTFT and TPOT at the given
percentile are within them; among those the best has the highest goodput (tokens/s of requests
within both SLOs), then the fewest cores. With none meeting them, the best goodput is shown as
the closest miss.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench_stats import Report
from pdserve.plan.simulator import Deployment, Workload, simulate

LOCAL_CAPS = (256, 1024, 4096)  # max_local_prefill_tokens tried with local prefill auto


def candidates(cores: int, threads: list[int], transport: str = "shm") -> list[Deployment]:
    out = []
    for t in threads:
        engines = cores // t
        for k in range(1, engines + 1):
            out.append(Deployment(f"colocated-{k}x{t}", colocated=k, threads=t))
        for p in range(1, engines):
            for d in range(1, engines - p + 1):
                name = f"{p}P{d}D-{t}"
                out.append(
                    Deployment(f"{name}-off", prefill=p, decode=d, threads=t, local_prefill="off", transport=transport)
                )
                out += [
                    Deployment(
                        f"{name}-local{cap}", prefill=p, decode=d, threads=t, max_local_tokens=cap, transport=transport
                    )
                    for cap in LOCAL_CAPS
                ]
    return out


@dataclass
class Scored:
    deployment: Deployment
    report: Report
    meets: bool

    def key(self):
        return (self.meets, round(self.report.goodput_tps, 1), -self.deployment.cores)


def within(rep: Report, slo_ttft: float | None, slo_tpot: float | None, percentile: str) -> bool:
    return (slo_ttft is None or rep.ttft_s[percentile] <= slo_ttft) and (
        slo_tpot is None or rep.tpot_s[percentile] <= slo_tpot
    )


def rank(
    profile: dict,
    workload: Workload,
    cores: int,
    slo_ttft: float | None,
    slo_tpot: float | None,
    percentile: str = "p95",
    transport: str = "shm",
) -> list[Scored]:
    threads = sorted(int(t) for t in profile["engines"])
    scored = []
    for dep in candidates(cores, threads, transport):
        rep = simulate(profile, dep, workload, slo_ttft, slo_tpot)
        scored.append(Scored(dep, rep, within(rep, slo_ttft, slo_tpot, percentile)))
    return sorted(scored, key=Scored.key, reverse=True)


def command(dep: Deployment) -> str:
    """The command that runs a deployment on this host."""
    if dep.colocated == 1:
        return f"pdserve colocated --num-threads {dep.threads}"
    if dep.colocated:
        return f"pdserve up --prefill 0 --decode {dep.colocated} --num-threads {dep.threads} --pin-cpus"
    local = (
        "--local-prefill off"
        if dep.local_prefill == "off"
        else f"--local-prefill auto --max-local-prefill-tokens {dep.max_local_tokens}"
    )
    return f"pdserve up --prefill {dep.prefill} --decode {dep.decode} --num-threads {dep.threads} --pin-cpus {local}"
