"""`pdserve plan`: every deployment a budget of cores or GPUs allows, simulated on the workload;
the best that meets the SLOs, and the runner-up.

Candidates: k colocated engines, and P prefill + D decode nodes with the router's local prefill
on (auto, at each local-token cap and each share of prompt tokens a decode node's step computes
beside its decodes; with a TPOT SLO, at the default cap also under a TPOT bound at each share
of the SLO in TPOT_BOUNDS) or off, using the whole budget or less. Of cores, each engine
takes its threads' worth (the thread counts the profile measured); of GPUs (a GPU's profile), one
GPU each. A candidate meets the SLOs when its TTFT and TPOT at the given percentile are within
them; among those the best has the highest goodput (tokens/s of requests within both SLOs), then
spends the least. Goodputs within 2% of the highest (TIE) tie: an open loop that every such deployment
serves gives each the offered load, differing only in when its last request ends, and no
workload's prediction is that close to a measured run. Among tied ones the best spends the least,
then leaves the most headroom under the SLOs (the least of SLO / latency at the percentile).
With none meeting them, the closest miss is shown: of the goodputs tied with the highest, the
most headroom, then the least spent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import DECODE_NODE_PREFILL_TOKENS
from kvtransfer.transports import TRANSPORTS
from pdserve.bench_stats import Report
from pdserve.plan.simulator import Deployment, Workload, simulate
from router.placement import MAX_LOCAL_TOKENS

LOCAL_CAPS = (256, 1024, 4096)  # max_local_prefill_tokens tried with local prefill auto
# prefill_tokens_with_decodes tried with local prefill auto: a smaller share keeps decode steps
# short where a prompt token costs more (fp32 on an AVX2 CPU: docs/benchmarks.md at 0f5299a, section 5)
BESIDE = (DECODE_NODE_PREFILL_TOKENS // 2, DECODE_NODE_PREFILL_TOKENS, 2 * DECODE_NODE_PREFILL_TOKENS)
# max_local_prefill_tpot tried with a TPOT SLO (at the default cap), as shares of it: a local prefill
# lengthens the steps it shares, so its bound sits under the SLO by about what it adds
TPOT_BOUNDS = (0.75, 0.9)
TIE = 0.02  # goodputs this close to the highest tie (docs/benchmarks.md at 0f5299a, "A trace")


def candidates(
    budget: int, threads: list[int], transport: str = "shm", gpu: bool = False, slo_tpot: float | None = None
) -> list[Deployment]:
    """Every deployment within `budget` cores (or GPUs, with gpu: one an engine, at the first
    thread count); slo_tpot: local prefills at the default cap also under its TPOT_BOUNDS."""
    shares = (round(share * slo_tpot, 4) for share in TPOT_BOUNDS) if slo_tpot else ()
    bounds = tuple(dict.fromkeys(b for b in shares if b > 0))  # (a TPOT SLO of microseconds: none)
    out = []
    for t in threads[:1] if gpu else threads:
        engines = budget if gpu else budget // t
        for k in range(1, engines + 1):
            out.append(Deployment(f"colocated-{k}x{t}", colocated=k, threads=t, gpu=gpu))
        for p in range(1, engines):
            for d in range(1, engines - p + 1):
                name = f"{p}P{d}D-{t}"
                each = dict(prefill=p, decode=d, threads=t, transport=transport, gpu=gpu)
                out.append(Deployment(f"{name}-off", local_prefill="off", **each))
                out += [
                    Deployment(
                        f"{name}-local{cap}-beside{n}" + (f"-tpot{bound}" if bound else ""),
                        max_local_tokens=cap,
                        prefill_tokens_with_decodes=n,
                        max_local_tpot=bound,
                        **each,
                    )
                    for cap in LOCAL_CAPS
                    for n in BESIDE
                    for bound in ((None, *bounds) if cap == MAX_LOCAL_TOKENS else (None,))
                ]
    return out


def on_gpu(profile: dict) -> bool:
    """Whether the profile's engines ran on a GPU (its budget is then GPUs)."""
    return "gpu" in profile.get("machine", {})


def default_transport(profile: dict) -> str:
    """The hand-off --kv-transport auto takes between two nodes of one host, of those the profile
    measured (a KV on a GPU offers no shared memory: TCP)."""
    return next((t for t in TRANSPORTS if t in profile["handoff"]), next(iter(profile["handoff"]), "shm"))


@dataclass
class Scored:
    deployment: Deployment
    report: Report
    meets: bool
    headroom: float = 0.0  # the least of SLO / latency at the percentile (< 1: over an SLO); 0 without SLOs
    tied: int = 0  # on the best: how many others tied its goodput (TIE)

    def key(self):
        return (self.meets, round(self.report.goodput_tps, 1), -self.deployment.spends)


def within(rep: Report, slo_ttft: float | None, slo_tpot: float | None, percentile: str) -> bool:
    return (slo_ttft is None or rep.ttft_s[percentile] <= slo_ttft) and (
        slo_tpot is None or rep.tpot_s[percentile] <= slo_tpot
    )


def headroom(rep: Report, slo_ttft: float | None, slo_tpot: float | None, percentile: str) -> float:
    """The least of SLO / latency at the percentile, over the SLOs given (> 1: within; 0: none given)."""
    pairs = ((slo_ttft, rep.ttft_s[percentile]), (slo_tpot, rep.tpot_s[percentile]))
    room = min((slo / max(latency, 1e-9) for slo, latency in pairs if slo is not None), default=0.0)
    return 0.0 if math.isnan(room) else room  # (nothing completed: no latency)


def rank(
    profile: dict,
    workload: Workload,
    budget: int,
    slo_ttft: float | None,
    slo_tpot: float | None,
    percentile: str = "p95",
    transport: str = "shm",
    gpu: bool = False,
) -> list[Scored]:
    """Every candidate within `budget` cores (GPUs, with gpu), best first."""
    threads = sorted(int(t) for t in profile["engines"])
    scored = []
    for dep in candidates(budget, threads, transport, gpu, slo_tpot):
        rep = simulate(profile, dep, workload, slo_ttft, slo_tpot)
        scored.append(
            Scored(dep, rep, within(rep, slo_ttft, slo_tpot, percentile), headroom(rep, slo_ttft, slo_tpot, percentile))
        )
    ranked = sorted(scored, key=Scored.key, reverse=True)
    lead = ranked[0]
    tied = [s.meets == lead.meets and s.report.goodput_tps >= (1 - TIE) * lead.report.goodput_tps for s in ranked]
    order = (
        (lambda s: (-s.deployment.spends, s.headroom)) if lead.meets else (lambda s: (s.headroom, -s.deployment.spends))
    )
    first = sorted((s for s, t in zip(ranked, tied) if t), key=order, reverse=True)
    first[0].tied = len(first) - 1
    return first + [s for s, t in zip(ranked, tied) if not t]


def command(dep: Deployment) -> str:
    """The command that runs a deployment on this host (--kv-transport where auto would take
    another: auto takes shared memory for a KV in host memory, TCP for one on a GPU)."""
    place = "--device cuda" if dep.gpu else f"--num-threads {dep.threads}"
    if dep.single_process:  # on the first cores of the budget, as profiled
        return f"pdserve colocated {place}" + ("" if dep.gpu else f" --cpus 0-{dep.threads - 1}")
    place += " --pin-gpus" if dep.gpu else " --pin-cpus"
    if dep.colocated:
        return f"pdserve up --prefill 0 --decode {dep.colocated} {place}"
    transport = dep.transport.removesuffix("-layerwise")
    if transport != ("tcp" if dep.gpu else "shm"):
        place += f" --kv-transport {transport}"
    local = (
        "--local-prefill off"
        if dep.local_prefill == "off"
        else f"--local-prefill auto --max-local-prefill-tokens {dep.max_local_tokens}"
    )
    if dep.max_local_tpot is not None and dep.local_prefill == "auto":
        local += f" --max-local-prefill-tpot {dep.max_local_tpot}"
    if dep.prefill_tokens_with_decodes is not None:
        local += f" --prefill-tokens-with-decodes {dep.prefill_tokens_with_decodes}"
    return f"pdserve up --prefill {dep.prefill} --decode {dep.decode} {place} {local}"
