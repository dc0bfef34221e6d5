"""Autoscaling policies for Ray Serve.

Serve calls a policy with an AutoscalingContext; `ctx.aggregated_metrics` holds what replicas
report from `record_autoscaling_stats()` (averaged over `look_back_period_s`), per replica.
The policy returns the desired replica count; Serve then applies min/max_replicas and the
upscale/downscale delays.

Two kinds. Threshold policies, one per pool, each on the signal that fits its phase
(PrefillPolicy, DecodePolicy), configured per deployment:

    autoscaling_config:
      policy:
        policy_function: pdserve.autoscaling:PrefillPolicy
        policy_kwargs: {target_pending_tokens: 2048}

And the planner's (PlannerPolicy): one application-level policy that sets both pools together
from what they observe (arrivals, prompt and output lengths, cache hits, local prefills) through
the step line `pdserve plan profile` measured, to the fewest replicas that hold the SLOs:

    applications:
      - autoscaling_policy:
          policy_function: pdserve.autoscaling:PlannerPolicy
          policy_kwargs: {profile: /path/profile.json, slo_ttft_s: 2.0, slo_tpot_s: 0.1}
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass

from pdserve.plan import profile_file
from pdserve.plan.step_model import Step, StepModel

log = logging.getLogger("ray.serve")


def _total(ctx, metric: str) -> float:
    return float(sum((ctx.aggregated_metrics or {}).get(metric, {}).values()))


class PrefillPolicy:
    """Prefill is compute-bound: scale on the prompt tokens waiting for (or in) a prefill, and on
    the requests waiting, whichever asks for more replicas."""

    def __init__(self, target_pending_tokens: float = 2048, target_pending_requests: float = 4):
        if target_pending_tokens <= 0 or target_pending_requests <= 0:
            raise ValueError("PrefillPolicy targets must be > 0")
        self.target_pending_tokens = target_pending_tokens
        self.target_pending_requests = target_pending_requests

    def __call__(self, ctx) -> tuple[int, dict]:
        desired = max(
            math.ceil(_total(ctx, "pending_tokens") / self.target_pending_tokens),
            math.ceil(_total(ctx, "pending_requests") / self.target_pending_requests),
        )
        return desired, {}


class DecodePolicy:
    """Decode is memory-bound: scale on running sequences per replica and on KV block utilization
    (the sum over replicas, e.g. 1.6 = 1.6 replicas' worth of full KV pools), whichever asks for
    more replicas."""

    def __init__(self, target_running_sequences: float = 32, target_kv_utilization: float = 0.7):
        if target_running_sequences <= 0 or not 0 < target_kv_utilization <= 1:
            raise ValueError("DecodePolicy: target_running_sequences must be > 0, target_kv_utilization in (0, 1]")
        self.target_running_sequences = target_running_sequences
        self.target_kv_utilization = target_kv_utilization

    def __call__(self, ctx) -> tuple[int, dict]:
        desired = max(
            math.ceil(_total(ctx, "running_sequences") / self.target_running_sequences),
            math.ceil(_total(ctx, "kv_utilization") / self.target_kv_utilization),
        )
        return desired, {}


MIN_PREFILL_UTILIZATION = 0.25


@dataclass
class Demand:
    """What the pools observed, per second (running_sequences and kv_* as held), summed over their
    replicas. Prompts prefilled on prefill nodes are remote; on decode nodes, local."""

    requests: float  # streams the decode pool started
    remote_prefills: float
    remote_new_tokens: float  # prompt tokens those prefills computed
    remote_cached_tokens: float  # and found in the prefix cache
    local_prefills: float
    local_new_tokens: float
    local_cached_tokens: float
    generated_tokens: float
    running_sequences: float
    kv_tokens: float  # tokens whose KV the decode replicas hold
    kv_utilization: float  # decode replicas' used KV share, summed

    @classmethod
    def observed(cls, prefill_ctx, decode_ctx) -> Demand:
        p, d = (lambda m: _total(prefill_ctx, m)), (lambda m: _total(decode_ctx, m))
        return cls(
            requests=d("requests"),
            remote_prefills=p("prefills"),
            remote_new_tokens=p("new_tokens"),
            remote_cached_tokens=p("cached_tokens"),
            local_prefills=d("local_prefills"),
            local_new_tokens=d("local_new_tokens"),
            local_cached_tokens=d("local_cached_tokens"),
            generated_tokens=d("generated_tokens"),
            running_sequences=d("running_sequences"),
            kv_tokens=d("kv_tokens"),
            kv_utilization=d("kv_utilization"),
        )


@dataclass
class Sizing:
    prefill: int
    decode: int
    prefill_seconds: float  # the mean prompt's prefill on the step line (remote and local)
    prefill_busy: float  # replica-seconds of prefill per second (local prefills included)
    prefill_utilization: float  # the most each prefill replica may be busy and meet the TTFT SLO
    decode_tpot_s: float  # the step line's TPOT at `decode` replicas


def _prefill_seconds(step: StepModel, prefills: float, new: float, cached: float) -> float:
    """One mean prompt of these prefills on the step line (0 without any)."""
    if prefills <= 0:
        return 0.0
    return step.seconds(Step([(max(1, round(new / prefills)), round(cached / prefills))], []))


def size_pools(
    demand: Demand,
    step: StepModel,
    serving: dict,
    slo_ttft_s: float,
    slo_tpot_s: float,
    max_replicas: int = 64,
    max_kv_utilization: float = 0.8,
) -> Sizing:
    """The fewest prefill and decode replicas whose modelled TTFT and TPOT meet the SLOs.

    Prefill: remote and local prompts each priced on the step line (a local prefill is often a
    short suffix on a cached history); the pool is busy their sum, replica-seconds a second, local
    prefills included (prefill demand the prefill pool should take); each replica may be busy up
    to the utilization at which an M/D/1 queue's TTFT, t + rho t / (2 (1 - rho)), meets the SLO (at
    most 0.9; a prompt too long for the SLO at any size: MIN_PREFILL_UTILIZATION).
    Decode: a replica decoding b sequences of the mean context (KV tokens held / sequences) steps
    a + c b seconds (the step line plus what serving adds); Little's law holds b = generated
    tokens/s x TPOT / D; the share of its time the local prefills take stretches the step:
    TPOT = a / (1 - u - c G / D), the smallest D at which it meets the SLO and the KV held is
    under max_kv_utilization. An idle pool asks for none (Serve's min_replicas decide); a request
    answered by its prefill alone (one output token) never reaches the decode pool."""
    t_remote = _prefill_seconds(step, demand.remote_prefills, demand.remote_new_tokens, demand.remote_cached_tokens)
    t_local = _prefill_seconds(step, demand.local_prefills, demand.local_new_tokens, demand.local_cached_tokens)
    prefills = demand.remote_prefills + demand.local_prefills
    busy = demand.remote_prefills * t_remote + demand.local_prefills * t_local
    t = busy / prefills if prefills > 0 else 0.0
    prefill, rho = 0, 0.0
    if prefills > 0:
        rho = MIN_PREFILL_UTILIZATION
        if t < slo_ttft_s:
            rho = min(0.9, max(rho, 2 * (slo_ttft_s - t) / (2 * slo_ttft_s - t)))
        prefill = min(max_replicas, math.ceil(busy / rho))

    decode, tpot = 0, 0.0
    if demand.generated_tokens > 0 or demand.local_prefills > 0:
        prompt = (
            (
                demand.remote_new_tokens
                + demand.remote_cached_tokens
                + demand.local_new_tokens
                + demand.local_cached_tokens
            )
            / prefills
            if prefills > 0
            else 0.0
        )
        context = demand.kv_tokens / demand.running_sequences if demand.running_sequences > 0 else prompt
        a = step.fixed + serving.get("fixed_s", 0.0)
        c = step.per_token + step.per_sequence + serving.get("per_sequence_s", 0.0) + step.per_context * context / 1e3
        local_busy = demand.local_prefills * t_local
        decode, tpot = max_replicas, math.inf
        for d in range(1, max_replicas + 1):
            slack = 1 - local_busy / d - c * demand.generated_tokens / d
            if slack > 0 and a / slack <= slo_tpot_s:
                decode, tpot = d, a / slack
                break
    decode = min(max_replicas, max(decode, math.ceil(demand.kv_utilization / max_kv_utilization)))
    return Sizing(prefill, decode, t, busy, rho, tpot)


def fit_budget(
    prefill: int, decode: int, prefill_bounds: tuple[int, int], decode_bounds: tuple[int, int], max_engines: int | None
) -> tuple[int, int]:
    """Each pool within its (min, max) replicas; with a budget of max_engines engines, what is
    above the two minimums is shared in proportion to what each pool asks above its minimum (an
    engine beyond the cores adds contention, not capacity)."""
    p, d = (min(hi, max(lo, n)) for n, (lo, hi) in ((prefill, prefill_bounds), (decode, decode_bounds)))
    if max_engines is None or p + d <= max_engines:
        return p, d
    lo_p, lo_d = prefill_bounds[0], decode_bounds[0]
    if lo_p + lo_d >= max_engines:
        return lo_p, lo_d
    spare, want_p, want_d = max_engines - lo_p - lo_d, p - lo_p, d - lo_d
    extra_p = math.floor(spare * want_p / (want_p + want_d))
    return lo_p + extra_p, lo_d + min(want_d, spare - extra_p)


class PlannerPolicy:
    """Application-level: sets Prefill and Decode together (size_pools, then fit_budget) from the
    pools' observed demand and the profile's step line for engines of `threads` threads. `cores`:
    the budget (Prefill + Decode engines x threads); Serve's upscale and downscale delays still
    apply per pool, so a pool shrinking and the other growing can overlap for a while."""

    def __init__(
        self,
        profile: str,
        slo_ttft_s: float,
        slo_tpot_s: float,
        threads: int = 1,
        max_kv_utilization: float = 0.8,
        cores: int | None = None,
        prefill: str = "Prefill",
        decode: str = "Decode",
    ):
        if slo_ttft_s <= 0 or slo_tpot_s <= 0 or not 0 < max_kv_utilization <= 1:
            raise ValueError("PlannerPolicy: slo_ttft_s and slo_tpot_s must be > 0, max_kv_utilization in (0, 1]")
        if threads < 1 or (cores is not None and cores < threads):
            raise ValueError(f"PlannerPolicy: threads must be >= 1 and cores >= threads, got {threads}, {cores}")
        prof = profile_file.load(profile)
        if str(threads) not in prof["engines"]:
            raise ValueError(
                f"PlannerPolicy: {profile} profiles engines of {sorted(prof['engines'])} threads, not {threads}"
            )
        self.step = StepModel(**prof["engines"][str(threads)]["step"])
        self.serving = prof.get("serving", {})
        self.slo_ttft_s, self.slo_tpot_s, self.max_kv_utilization = slo_ttft_s, slo_tpot_s, max_kv_utilization
        self.names = (prefill, decode)
        self.max_engines = None if cores is None else cores // threads
        self.last: tuple | str = ()

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        """Never raises: an error inside Serve's control loop would stall every application's
        updates; it is logged (once while it repeats) and the targets stay as they are."""
        try:
            return self._decide(contexts)
        except Exception as e:
            if self.last != repr(e):
                self.last = repr(e)
                log.exception("PlannerPolicy: targets left as they are")
            return {}, {}

    def _decide(self, contexts: dict) -> tuple[dict, dict]:
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        missing = [n for n in self.names if n not in by_name]
        if missing:
            raise ValueError(f"PlannerPolicy: no autoscaled deployment named {missing} (it sizes {self.names})")
        (p_id, p_ctx), (d_id, d_ctx) = (by_name[n] for n in self.names)
        demand = Demand.observed(p_ctx, d_ctx)
        most = max(p_ctx.capacity_adjusted_max_replicas, d_ctx.capacity_adjusted_max_replicas)
        sizing = size_pools(
            demand, self.step, self.serving, self.slo_ttft_s, self.slo_tpot_s, most, self.max_kv_utilization
        )
        bounds = [(c.capacity_adjusted_min_replicas, c.capacity_adjusted_max_replicas) for c in (p_ctx, d_ctx)]
        targets = fit_budget(sizing.prefill, sizing.decode, *bounds, self.max_engines)
        why = {"demand": asdict(demand), "sizing": asdict(sizing), "targets": targets}
        if targets != self.last:  # in the Serve controller's log
            self.last = targets
            log.info("PlannerPolicy: Prefill %d, Decode %d replicas for %s", *targets, json.dumps(why))
        return {p_id: targets[0], d_id: targets[1]}, {p_id: why, d_id: why}
