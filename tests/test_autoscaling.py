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

from pdserve.autoscaling import Demand, PlannerPolicy, fit_budget, size_pools
from pdserve.plan.simulator import Deployment, simulate, synthetic
from pdserve.plan.step_model import StepModel
from serving.rates import Rates

STEP = StepModel(fixed=0.045, per_token=0.0034, per_pair=0.0015, per_context=0.0045, per_sequence=0.0018)
SERVING = {"fixed_s": 0.007, "per_sequence_s": 0.0009}
SLO_TTFT, SLO_TPOT = 6.0, 0.12


def demand(rate: float, prompt: int = 600, output: int = 64, hit: float = 0.0, local: float = 0.0, kv: float = 0.1):
    """rate requests/s of `prompt` tokens (a share `hit` cached), a share `local` prefilled on
    decode nodes, `output` tokens out; the decode pool holds rate x 100 ms x output sequences."""
    remote, here = rate * (1 - local), rate * local
    running = rate * output * 0.1
    return Demand(
        requests=rate,
        remote_prefills=remote,
        remote_new_tokens=remote * prompt * (1 - hit),
        remote_cached_tokens=remote * prompt * hit,
        local_prefills=here,
        local_new_tokens=here * prompt * (1 - hit),
        local_cached_tokens=here * prompt * hit,
        generated_tokens=rate * output,
        running_sequences=running,
        kv_tokens=running * (prompt + output / 2),
        kv_utilization=kv,
    )


def idle(**kw) -> Demand:
    return Demand(**{f.name: 0.0 for f in dataclasses.fields(Demand)} | kw)


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


bounds = st.tuples(st.integers(0, 3), st.integers(0, 8)).map(lambda b: (b[0], b[0] + b[1]))


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), bounds, bounds, st.one_of(st.none(), st.integers(1, 16)))
def test_a_core_budget_caps_both_pools_together_within_their_bounds(prefill, decode, p_bounds, d_bounds, engines):
    p, d = fit_budget(prefill, decode, p_bounds, d_bounds, engines)
    want_p, want_d = (min(hi, max(lo, n)) for n, (lo, hi) in ((prefill, p_bounds), (decode, d_bounds)))
    assert p_bounds[0] <= p <= want_p and d_bounds[0] <= d <= want_d
    if engines is None or want_p + want_d <= engines:
        assert (p, d) == (want_p, want_d)
    else:  # the budget spent, never exceeded above the two minimums
        assert p + d == max(engines, p_bounds[0] + d_bounds[0])


def test_idle_pools_go_to_their_minimum_but_keep_the_kv_they_hold():
    s = size(idle(kv_utilization=1.7))
    assert (s.prefill, s.decode) == (0, 3)


def test_prompts_answered_by_their_prefill_alone_grow_only_the_prefill_pool():
    """max_tokens=1: the prefill's token is the answer, no request reaches the decode pool."""
    s = size(idle(remote_prefills=2.0, remote_new_tokens=1800))
    assert s.prefill > 1 and s.decode == 0


def test_long_streams_keep_the_decode_pool_without_new_requests():
    """A window in which no request arrived but streams decode: the tokens are the demand."""
    d = demand(200 / 64)
    held = ("generated_tokens", "running_sequences", "kv_tokens", "kv_utilization")
    assert size(idle(**{k: getattr(d, k) for k in held})).decode == size(d).decode > 1


def test_local_prefills_are_priced_as_what_they_compute():
    """A local prefill of 50 new tokens on a 2,000-token cached history costs what it computes,
    not what the remote 2,000-token prompts beside it cost."""
    remote = idle(
        remote_prefills=0.5,
        remote_new_tokens=1000,
        requests=1.0,
        generated_tokens=64,
        running_sequences=6,
        kv_tokens=6 * 2000,
    )
    both = dataclasses.replace(remote, local_prefills=0.5, local_new_tokens=25, local_cached_tokens=1000)
    assert size(both).prefill_busy - size(remote).prefill_busy < 0.5 * 0.5  # half a second or less each
    whole = dataclasses.replace(both, local_new_tokens=1000, local_cached_tokens=0)  # 2,000 new tokens each
    assert size(whole).decode > size(both).decode >= size(remote).decode  # they share the decode steps


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


def _ctx(name: str, metrics: dict, least: int = 1, most: int = 8):
    by_replica = {k: {"r1": v / 2, "r2": v / 2} for k, v in metrics.items()}  # two replicas report
    return SimpleNamespace(
        deployment_name=name,
        aggregated_metrics=by_replica,
        capacity_adjusted_min_replicas=least,
        capacity_adjusted_max_replicas=most,
    )


def _profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps({"version": 2, "engines": {"1": {"step": dataclasses.asdict(STEP)}}, "serving": SERVING})
    )
    return str(path)


def test_the_planner_policy_sets_both_pools_from_what_they_report(tmp_path):
    rate, d = 1.2, demand(1.2, local=0.2, kv=0.2)
    prefill = _ctx("Prefill", {"prefills": d.remote_prefills, "new_tokens": d.remote_new_tokens, "cached_tokens": 0})
    decode = _ctx(
        "Decode",
        {
            "requests": rate,
            "local_prefills": d.local_prefills,
            "local_new_tokens": d.local_new_tokens,
            "local_cached_tokens": 0,
            "generated_tokens": d.generated_tokens,
            "running_sequences": d.running_sequences,
            "kv_tokens": d.kv_tokens,
            "kv_utilization": 0.2,
        },
    )
    contexts = {"p": prefill, "d": decode, "router": _ctx("Router", {})}
    targets, state = PlannerPolicy(_profile(tmp_path), slo_ttft_s=SLO_TTFT, slo_tpot_s=SLO_TPOT)(contexts)
    expected = size(d)
    assert targets == {"p": expected.prefill, "d": expected.decode} and expected.prefill > 1
    assert state["p"]["sizing"]["prefill_busy"] == pytest.approx(expected.prefill_busy)  # local prefills in it
    capped = PlannerPolicy(_profile(tmp_path), slo_ttft_s=SLO_TTFT, slo_tpot_s=SLO_TPOT, cores=3)(contexts)[0]
    assert capped["p"] + capped["d"] == 3 and min(capped.values()) >= 1


def test_the_planner_policy_names_what_is_wrong(tmp_path):
    path = _profile(tmp_path)
    with pytest.raises(ValueError, match="threads"):
        PlannerPolicy(path, slo_ttft_s=1, slo_tpot_s=0.1, threads=4)
    with pytest.raises(ValueError, match="slo_tpot_s"):
        PlannerPolicy(path, slo_ttft_s=1, slo_tpot_s=0)
    with pytest.raises(ValueError, match="cores"):
        PlannerPolicy(path, slo_ttft_s=1, slo_tpot_s=0.1, cores=0)
    # inside Serve's control loop it never raises (that would stall every application): it logs
    # and leaves the targets as they are
    policy = PlannerPolicy(path, slo_ttft_s=1, slo_tpot_s=0.1, decode="Decoders")
    assert policy({"p": _ctx("Prefill", {}), "d": _ctx("Decode", {})}) == ({}, {})


def test_rates_are_changes_per_second_between_readings():
    now, total = [0.0], [0]
    rates = Rates({"tokens": lambda: total[0]}, clock=lambda: now[0])
    total[0], now[0] = 30, 2.0
    assert rates.read() == {"tokens": 15.0}
    assert rates.read() == {"tokens": 0.0}  # no time passed
    total[0], now[0] = 40, 7.0
    assert rates.read() == {"tokens": 2.0}
