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
    """What the pools observed, per second, summed over their replicas."""

    requests: float  # requests the decode pool took
    prefills: float  # prompts prefilled: on prefill nodes and locally on decode nodes
    local_prefills: float
    new_tokens: float  # prompt tokens those prefills computed
    cached_tokens: float  # and found in the prefix cache
    generated_tokens: float
    kv_utilization: float  # decode replicas' used KV share, summed

    @classmethod
    def observed(cls, prefill_ctx, decode_ctx) -> Demand:
        p, d = (lambda m: _total(prefill_ctx, m)), (lambda m: _total(decode_ctx, m))
        return cls(
            requests=d("requests"),
            prefills=p("prefills") + d("local_prefills"),
            local_prefills=d("local_prefills"),
            new_tokens=p("new_tokens") + d("local_new_tokens"),
            cached_tokens=p("cached_tokens") + d("local_cached_tokens"),
            generated_tokens=d("generated_tokens"),
            kv_utilization=d("kv_utilization"),
        )


@dataclass
class Sizing:
    prefill: int
    decode: int
    prefill_seconds: float  # one prompt's prefill on the step line
    prefill_busy: float  # replica-seconds of prefill per second (local prefills included)
    prefill_utilization: float  # the most each prefill replica may be busy and meet the TTFT SLO
    decode_tpot_s: float  # the step line's TPOT at `decode` replicas


def size_pools(
    demand: Demand,
    step: StepModel,
    serving: dict,
    slo_ttft_s: float,
    slo_tpot_s: float,
    max_replicas: int = 64,
    max_kv_utilization: float = 0.8,
    max_engines: int | None = None,
) -> Sizing:
    """The fewest prefill and decode replicas whose modelled TTFT and TPOT meet the SLOs.

    Prefill: the mean prompt's time t on the step line; the pool is busy prefills/s x t
    replica-seconds a second, local prefills included (they are prefill demand the prefill pool
    should take); each replica may be busy up to the utilization at which an M/D/1 queue's TTFT,
    t + rho t / (2 (1 - rho)), meets the SLO (at most 0.9; a prompt too long for the SLO at any
    size: MIN_PREFILL_UTILIZATION, queueing a sixth of its own time).
    Decode: a replica decoding b sequences of the mean context steps a + c b seconds (the step
    line plus what serving adds), and Little's law holds b = generated tokens/s x TPOT / D; the
    share of its time the local prefills take stretches the step. TPOT = a / (1 - u - c G / D):
    the smallest D at which it meets the SLO and the KV held is under max_kv_utilization.
    max_engines (the cores a budget has, over threads an engine): P + D never more; a pool that
    needs any keeps at least one, and the rest is shared in proportion to need (an engine beyond
    the cores adds contention, not capacity)."""
    # An idle pool asks for none (Serve's min_replicas decide); a request answered by its prefill
    # alone (one output token) never reaches the decode pool; means are over Serve's look-back window.
    t = busy = rho = 0.0
    prefill, prompt = 0, 0.0
    if demand.prefills > 0:
        new, cached = demand.new_tokens / demand.prefills, demand.cached_tokens / demand.prefills
        prompt = new + cached
        t = step.seconds(Step([(max(1, round(new)), round(cached))], []))
        busy = demand.prefills * t
        rho = MIN_PREFILL_UTILIZATION
        if t < slo_ttft_s:
            rho = min(0.9, max(rho, 2 * (slo_ttft_s - t) / (2 * slo_ttft_s - t)))
        prefill = min(max_replicas, math.ceil(busy / rho))

    decode, tpot = 0, 0.0
    if demand.generated_tokens > 0 or demand.local_prefills > 0:  # long streams: no new request in a window
        context = prompt + (demand.generated_tokens / demand.requests / 2 if demand.requests > 0 else 0.0)
        a = step.fixed + serving.get("fixed_s", 0.0)
        c = step.per_token + step.per_sequence + serving.get("per_sequence_s", 0.0) + step.per_context * context / 1e3
        local_busy = demand.local_prefills * t
        decode, tpot = max_replicas, math.inf
        for d in range(1, max_replicas + 1):
            slack = 1 - local_busy / d - c * demand.generated_tokens / d
            if slack > 0 and a / slack <= slo_tpot_s:
                decode, tpot = d, a / slack
                break
    decode = min(max_replicas, max(decode, math.ceil(demand.kv_utilization / max_kv_utilization)))
    if max_engines is not None and prefill + decode > max_engines:
        share = max(min(1, prefill), math.floor(max_engines * prefill / (prefill + decode)))
        prefill, decode = share, max(min(1, decode), max_engines - share)
    return Sizing(prefill, decode, t, busy, rho, tpot)


class PlannerPolicy:
    """Application-level: sets Prefill and Decode together (size_pools) from the pools' observed
    demand and the profile's step line for engines of `threads` threads."""

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
        prof = profile_file.load(profile)
        if str(threads) not in prof["engines"]:
            raise ValueError(
                f"PlannerPolicy: {profile} profiles engines of {sorted(prof['engines'])} threads, not {threads}"
            )
        self.step = StepModel(**prof["engines"][str(threads)]["step"])
        self.serving = prof.get("serving", {})
        self.slo_ttft_s, self.slo_tpot_s, self.max_kv_utilization = slo_ttft_s, slo_tpot_s, max_kv_utilization
        self.names = (prefill, decode)
        self.max_engines = None if cores is None else max(2, cores // threads)
        self.last = (-1, -1)

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        missing = [n for n in self.names if n not in by_name]
        if missing:
            raise ValueError(f"PlannerPolicy: no autoscaled deployment named {missing} (it sizes {self.names})")
        (p_id, p_ctx), (d_id, d_ctx) = (by_name[n] for n in self.names)
        demand = Demand.observed(p_ctx, d_ctx)
        most = max(p_ctx.capacity_adjusted_max_replicas, d_ctx.capacity_adjusted_max_replicas)
        sizing = size_pools(
            demand,
            self.step,
            self.serving,
            self.slo_ttft_s,
            self.slo_tpot_s,
            most,
            self.max_kv_utilization,
            self.max_engines,
        )
        why = {"demand": asdict(demand), "sizing": asdict(sizing)}
        if (sizing.prefill, sizing.decode) != self.last:  # in the Serve controller's log
            self.last = (sizing.prefill, sizing.decode)
            log.info("PlannerPolicy: Prefill %d, Decode %d replicas for %s", *self.last, json.dumps(why))
        return {p_id: sizing.prefill, d_id: sizing.decode}, {p_id: why, d_id: why}
