"""What a serving benchmark reports, computed from per-request records.

TTFT: request sent -> first token received. TPOT: (last token - first token) / (tokens - 1).
E2E latency: request sent -> last token (= TTFT + TPOT x (n - 1)). TPS: output tokens / wall
time of the run; QPS: completed requests / wall time. Goodput: requests/s (and their tokens/s)
of the requests that met every SLO given. Max concurrency: most requests in flight at once.
Failed requests count by status and never enter the latency statistics.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    sent: float  # seconds since the run started
    first_token: float | None = None
    done: float | None = None
    num_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefilling node's prefix cache held
    local_prefill: bool = False  # prefilled on its decode node (conditional disaggregation)
    error: str | None = None  # a gRPC status name when it failed

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None and self.first_token is not None

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.done - self.first_token) / (self.num_tokens - 1) if self.num_tokens > 1 else None


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {k: math.nan for k in ("mean", "p50", "p95", "p99", "max")}
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def max_concurrency(records: list[RequestRecord]) -> int:
    events = []
    for r in records:
        end = r.done if r.done is not None else r.sent
        events += [(r.sent, 1), (end, -1)]
    level = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        level += delta
        peak = max(peak, level)
    return peak


@dataclass
class Report:
    num_requests: int
    completed: int
    errors: dict[str, int]
    duration_s: float
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    e2e_s: dict[str, float]
    tps: float
    qps: float
    max_concurrency: int
    slo_ttft_s: float | None
    slo_tpot_s: float | None
    good_requests: int
    goodput_rps: float
    goodput_tps: float
    prefix_cache_hit_rate: float = 0.0  # cached / prompt tokens of completed requests
    local_prefill_rate: float = 0.0  # completed requests prefilled on their decode node
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def report(
    records: list[RequestRecord], duration_s: float, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None
) -> Report:
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = r.error or "INCOMPLETE"
            errors[key] = errors.get(key, 0) + 1

    def good(r: RequestRecord) -> bool:
        return (slo_ttft_s is None or r.ttft <= slo_ttft_s) and (
            slo_tpot_s is None or r.tpot is None or r.tpot <= slo_tpot_s
        )

    good_requests = [r for r in ok if good(r)]
    tokens = sum(r.num_tokens for r in ok)
    return Report(
        num_requests=len(records),
        completed=len(ok),
        errors=errors,
        duration_s=duration_s,
        ttft_s=summarize([r.ttft for r in ok]),
        tpot_s=summarize([r.tpot for r in ok if r.tpot is not None]),
        e2e_s=summarize([r.e2e for r in ok]),
        tps=tokens / duration_s,
        qps=len(ok) / duration_s,
        max_concurrency=max_concurrency(records),
        slo_ttft_s=slo_ttft_s,
        slo_tpot_s=slo_tpot_s,
        good_requests=len(good_requests),
        goodput_rps=len(good_requests) / duration_s,
        goodput_tps=sum(r.num_tokens for r in good_requests) / duration_s,
        prefix_cache_hit_rate=sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        local_prefill_rate=sum(r.local_prefill for r in ok) / max(1, len(ok)),
    )


def format_report(rep: Report, label: str = "") -> str:
    def row(name: str, s: dict[str, float], scale: float = 1e3, unit: str = "ms") -> str:
        return (
            f"  {name:<5} mean {s['mean'] * scale:8.1f}  p50 {s['p50'] * scale:8.1f}  p95 {s['p95'] * scale:8.1f}"
            f"  p99 {s['p99'] * scale:8.1f}  max {s['max'] * scale:8.1f} {unit}"
        )

    slo = ", ".join(
        x
        for x in (
            f"TTFT <= {rep.slo_ttft_s * 1e3:.0f} ms" if rep.slo_ttft_s else "",
            f"TPOT <= {rep.slo_tpot_s * 1e3:.0f} ms" if rep.slo_tpot_s else "",
        )
        if x
    )
    goodput = (
        f"  goodput ({slo}): {rep.good_requests} requests, {rep.goodput_rps:.2f} requests/s, "
        f"{rep.goodput_tps:.1f} tokens/s"
        if slo
        else "  goodput: no SLO given (--slo-ttft SECONDS, --slo-tpot SECONDS per token)"
    )
    lines = [
        f"{label}{rep.completed}/{rep.num_requests} requests completed in {rep.duration_s:.2f} s"
        + (f"; errors: {rep.errors}" if rep.errors else ""),
        row("TTFT", rep.ttft_s),
        row("TPOT", rep.tpot_s),
        row("E2E", rep.e2e_s),
        f"  TPS {rep.tps:.1f} output tokens/s, QPS {rep.qps:.2f} requests/s, max concurrency {rep.max_concurrency}, "
        f"prefix cache hit rate {rep.prefix_cache_hit_rate:.1%} of prompt tokens, "
        f"{rep.local_prefill_rate:.0%} prefilled on the decode node",
        goodput,
    ]
    return "\n".join(lines)
