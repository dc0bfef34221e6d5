"""The autoscaling policies (pdserve/autoscaling.py) without a cluster: the planner's pool sizing
(its properties, and its sizes against the simulator on the same profile), the application-level
policy as Serve calls it, and the rates replicas report. Under Ray: tests/test_ray.py."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.autoscaling import Demand, PlannerPolicy, size_pools
from pdserve.plan.simulator import Deployment, simulate, synthetic
from pdserve.plan.step_model import StepModel
from serving.rates import Rates

STEP = StepModel(fixed=0.045, per_token=0.0034, per_pair=0.0015, per_context=0.0045, per_sequence=0.0018)
SERVING = {"fixed_s": 0.007, "per_sequence_s": 0.0009}
SLO_TTFT, SLO_TPOT = 6.0, 0.12


def demand(rate: float, prompt: int = 600, output: int = 64, hit: float = 0.0, local: float = 0.0, kv: float = 0.1):
    return Demand(
        requests=rate,
        prefills=rate,
        local_prefills=local * rate,
        new_tokens=rate * prompt * (1 - hit),
        cached_tokens=rate * prompt * hit,
        generated_tokens=rate * output,
        kv_utilization=kv,
    )


def size(d: Demand, **kw):
    return size_pools(d, STEP, SERVING, kw.pop("ttft", SLO_TTFT), kw.pop("tpot", SLO_TPOT), **kw)


rates = st.floats(0.01, 3.0)
shares = st.floats(0.0, 0.95)


@settings(max_examples=200, deadline=None)
@given(rates, rates, st.integers(16, 2000), st.integers(1, 400), shares, shares)
def test_more_demand_never_fewer_replicas(r1, r2, prompt, output, hit, local):
    lo, hi = sorted((r1, r2))
    a, b = size(demand(lo, prompt, output, hit, local)), size(demand(hi, prompt, output, hit, local))
    assert a.prefill <= b.prefill and a.decode <= b.decode, (a, b)


@settings(max_examples=300, deadline=None)
@given(rates, st.integers(64, 4000), shares, shares, st.floats(0.05, 20.0))
def test_cache_hits_need_no_more_prefill_and_local_prefills_count_as_prefill_demand(rate, prompt, h1, local, ttft):
    lo, hi = sorted((h1, min(0.95, h1 + 0.3)))
    assert (
        size(demand(rate, prompt, hit=hi), ttft=ttft).prefill <= size(demand(rate, prompt, hit=lo), ttft=ttft).prefill
    )
    # prompts prefilled on decode nodes instead: the prefill pool sized as for all of them, and the
    # decode pool at least as large (those prefills share its steps)
    remote, here = size(demand(rate, prompt)), size(demand(rate, prompt, local=local))
    assert here.prefill == remote.prefill and here.decode >= remote.decode


@settings(max_examples=200, deadline=None)
@given(rates, st.integers(16, 2000), st.integers(1, 400), shares, st.floats(0.0, 3.0))
def test_decode_is_the_fewest_replicas_that_meet_tpot_and_hold_the_kv(rate, prompt, output, local, kv):
    d = demand(rate, prompt, output, local=local, kv=kv)
    s = size(d)
    if s.decode < 64:
        assert s.decode_tpot_s <= SLO_TPOT or s.decode == -(-kv // 0.8)
        assert s.decode >= kv / 0.8
    if s.decode > 1 and s.decode > -(-kv // 0.8):  # one fewer misses the SLO
        fewer = size(d, max_replicas=s.decode - 1)
        assert fewer.decode == s.decode - 1 and fewer.decode_tpot_s > SLO_TPOT


@settings(max_examples=300, deadline=None)
@given(rates, st.integers(16, 2000), st.integers(1, 400), shares, st.floats(0.0, 3.0), st.integers(2, 16))
def test_a_core_budget_caps_both_pools_together(rate, prompt, output, local, kv, engines):
    d = demand(rate, prompt, output, local=local, kv=kv)
    free, capped = size(d), size(d, max_engines=engines)
    assert capped.prefill + capped.decode <= max(engines, free.prefill + free.decode)
    assert capped.prefill + capped.decode <= engines or (capped.prefill, capped.decode) == (free.prefill, free.decode)
    assert min(1, free.prefill) <= capped.prefill <= free.prefill  # a pool in need keeps a replica
    assert min(1, free.decode) <= capped.decode <= free.decode


def test_idle_pools_go_to_their_minimum_but_keep_the_kv_they_hold():
    s = size(Demand(0, 0, 0, 0, 0, 0, kv_utilization=1.7))
    assert (s.prefill, s.decode) == (0, 3)


def test_prompts_answered_by_their_prefill_alone_grow_only_the_prefill_pool():
    """max_tokens=1: the prefill's token is the answer, no request reaches the decode pool."""
    s = size(
        Demand(
            requests=0,
            prefills=2.0,
            local_prefills=0,
            new_tokens=1800,
            cached_tokens=0,
            generated_tokens=0,
            kv_utilization=0,
        )
    )
    assert s.prefill > 1 and s.decode == 0


def test_long_streams_keep_the_decode_pool_without_new_requests():
    """A window in which no request arrived but streams decode: the tokens are the demand."""
    busy = size(
        Demand(
            requests=0,
            prefills=0,
            local_prefills=0,
            new_tokens=0,
            cached_tokens=0,
            generated_tokens=200,
            kv_utilization=0.5,
        )
    )
    assert busy.decode == size(demand(200 / 64, prompt=0)).decode > 1


@pytest.mark.parametrize("rate", [0.1, 0.6, 1.2])
def test_the_sizes_meet_the_slos_in_the_simulator(rate):
    """The same step line through the simulator (the router's own placement code): the sizes meet
    the SLOs at p50 in float32's profile shape, and one decode replica fewer misses TPOT where
    the sizing asked for more than one."""
    prof = {
        "engines": {
            "1": {
                "step": dataclasses.asdict(STEP),
                "block_size": 16,
                "max_num_batched_tokens": 4096,
                "num_kv_blocks": 4096,
            }
        },
        "handoff": {"shm": {"fixed_s": 0.002, "per_token_s": 1e-6}},
        "router_s": 0.002,
        "serving": SERVING,
    }
    s = size(demand(rate))
    workload = synthetic(150, "600", "64", rate=rate)
    got = simulate(prof, Deployment("sized", prefill=s.prefill, decode=s.decode, local_prefill="off"), workload)
    assert got.ttft_s["p50"] <= SLO_TTFT and got.tpot_s["p50"] <= SLO_TPOT, (s, got.ttft_s, got.tpot_s)
    if s.decode > 1:
        fewer = Deployment("fewer", prefill=s.prefill, decode=s.decode - 1, local_prefill="off")
        assert simulate(prof, fewer, workload).tpot_s["p50"] > SLO_TPOT


def _ctx(name: str, metrics: dict, most: int = 8):
    by_replica = {k: {"r1": v / 2, "r2": v / 2} for k, v in metrics.items()}  # two replicas report
    return SimpleNamespace(deployment_name=name, aggregated_metrics=by_replica, capacity_adjusted_max_replicas=most)


def _profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps({"version": 2, "engines": {"1": {"step": dataclasses.asdict(STEP)}}, "serving": SERVING})
    )
    return str(path)


def test_the_planner_policy_sets_both_pools_from_what_they_report(tmp_path):
    policy = PlannerPolicy(_profile(tmp_path), slo_ttft_s=SLO_TTFT, slo_tpot_s=SLO_TPOT)
    rate = 1.2
    prefill = _ctx("Prefill", {"prefills": 0.8 * rate, "new_tokens": 0.8 * rate * 600, "cached_tokens": 0})
    decode = _ctx(
        "Decode",
        {
            "requests": rate,
            "local_prefills": 0.2 * rate,
            "local_new_tokens": 0.2 * rate * 600,
            "local_cached_tokens": 0,
            "generated_tokens": rate * 64,
            "kv_utilization": 0.2,
        },
    )
    targets, state = policy({"p": prefill, "d": decode, "router": _ctx("Router", {})})
    expected = size(demand(rate, local=0.2, kv=0.2))
    assert targets == {"p": expected.prefill, "d": expected.decode} and expected.prefill > 1
    assert state["p"]["demand"]["prefills"] == pytest.approx(rate)  # local prefills in the prefill demand


def test_the_planner_policy_names_what_is_wrong(tmp_path):
    path = _profile(tmp_path)
    with pytest.raises(ValueError, match="threads"):
        PlannerPolicy(path, slo_ttft_s=1, slo_tpot_s=0.1, threads=4)
    with pytest.raises(ValueError, match="slo_tpot_s"):
        PlannerPolicy(path, slo_ttft_s=1, slo_tpot_s=0)
    policy = PlannerPolicy(path, slo_ttft_s=1, slo_tpot_s=0.1, decode="Decoders")
    with pytest.raises(ValueError, match="Decoders"):
        policy({"p": _ctx("Prefill", {}), "d": _ctx("Decode", {})})


def test_rates_are_changes_per_second_between_readings():
    now, total = [0.0], [0]
    rates = Rates({"tokens": lambda: total[0]}, clock=lambda: now[0])
    total[0], now[0] = 30, 2.0
    assert rates.read() == {"tokens": 15.0}
    assert rates.read() == {"tokens": 0.0}  # no time passed
    total[0], now[0] = 40, 7.0
    assert rates.read() == {"tokens": 2.0}
