"""Autoscaling policies for Ray Serve, one per pool, each on the signal that fits its phase.

Serve calls a policy with an AutoscalingContext; `ctx.aggregated_metrics` holds what replicas
report from `record_autoscaling_stats()` (averaged over `look_back_period_s`), per replica.
The policy returns the desired replica count; Serve then applies min/max_replicas and the
upscale/downscale delays. Configured per deployment:

    autoscaling_config:
      policy:
        policy_function: pdserve.autoscaling:PrefillPolicy
        policy_kwargs: {target_pending_tokens: 2048}
"""

from __future__ import annotations

import math


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
