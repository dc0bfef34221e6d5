"""`pdserve plan profile / simulate / best`: the step line, the simulator's arithmetic on a profile
written by hand, that it runs the router's own placement and pool code, and the commands end to end
on a profile measured here (tiny model)."""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import router.placement
import router.pool
from engine import EngineConfig
from engine.config import DECODE_NODE_PREFILL_TOKENS
from pdserve.cli import parser
from pdserve.plan import profile as profiles
from pdserve.plan import profile_file, search
from pdserve.plan.simulator import (
    ARRIVAL_JITTER_S,
    Decoding,
    Deployment,
    Item,
    Prefill,
    Simulation,
    Workload,
    simulate,
    synthetic,
    timing_spread,
)
from pdserve.plan.step_model import Step, StepModel

ROOT = Path(__file__).resolve().parents[1]
ROUTER_S, FIXED, PER_TOKEN, HANDOFF = 0.001, 0.01, 0.001, 0.005


def hand_profile(**step) -> dict:
    line = {"fixed": FIXED, "per_token": PER_TOKEN, "per_pair": 0.0, "per_context": 0.0, "per_sequence": 0.0} | step
    engine = {"block_size": 16, "max_num_batched_tokens": 4096, "num_kv_blocks": 10_000, "step": line}
    return {
        "version": profile_file.VERSION,
        "router_s": ROUTER_S,
        "engines": {"1": engine, "2": engine | {"step": {**line, "per_token": PER_TOKEN / 2}}},
        "handoff": {"shm": {"fixed_s": HANDOFF, "per_token_s": 0.0}},
        "serving": profiles.NO_OVERHEAD,
    }


def one(prompt_len: int, output_len: int) -> Workload:
    return Workload([Item([list(range(1, prompt_len + 1))], output_len)], concurrency=1)


def test_the_step_line_recovers_the_costs_it_was_made_of():
    truth = StepModel(0.004, 2e-4, 3e-4, 5e-3, 1e-4, 2e-3, 4e-3)
    steps = [Step([(n, c)], []) for n in (16, 128, 700) for c in (0, 512)]
    steps += [Step([], [ctx] * b) for b in (1, 8, 32) for ctx in (64, 900)]  # no block shared
    steps += [Step([], [ctx] * b, (b - 1) * (ctx // 16 - 1) * 16) for b in (8, 32) for ctx in (64, 900)]  # a prefix
    steps += [Step([(256, 0)], [640] * 4)]
    fit = StepModel.fit([(s, truth.seconds(s)) for s in steps])
    for got, want in zip(fit.coefficients(), truth.coefficients()):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_the_distinct_context_leaves_out_the_copies_of_shared_blocks():
    assert Step([], [100, 100], 64).features()[-1] == pytest.approx(0.136)  # 200 tokens, 64 of them a second copy
    assert Step([], [100, 100]).features()[-1] == Step([], [100, 100]).features()[3]
    # without a sample that shares blocks the two context terms are one: the fit leaves per_distinct at 0
    truth = StepModel(0.004, 2e-4, 0.0, 5e-3, 0.0)
    steps = [Step([], [ctx] * b) for b in (1, 4, 16) for ctx in (64, 640)] + [Step([(64, 0)], [])]
    fit = StepModel.fit([(s, truth.seconds(s)) for s in steps])
    assert fit.per_distinct == 0.0 and fit.per_context == pytest.approx(5e-3)


@pytest.mark.parametrize("transport, shares", [("shm", True), ("grpc", False)])
def test_sequences_with_a_common_prefix_decode_in_cheaper_steps(transport, shares):
    """The simulator counts the blocks decoding sequences share (a cached prefix, on their engine or
    imported by a hand-off that leaves out the blocks a decode node holds), and no more: where
    nothing is shared, a distinct-context cost simulates exactly as the same context cost."""
    distinct, context = hand_profile(per_distinct=0.05), hand_profile(per_context=0.05)
    for prof in (distinct, context):
        prof["handoff"]["grpc"] = prof["handoff"]["shm"]
    prefix = list(range(1, 161))  # 10 blocks
    common = Workload([Item([prefix + [500 + i] * 16], 8) for i in range(4)], concurrency=4)
    apart = Workload([Item([[1000 * (i + 1) + j for j in range(176)]], 8) for i in range(4)], concurrency=4)

    def times(prof: dict, dep: Deployment, work: Workload) -> list[tuple]:
        sim = Simulation(prof, dep, 30.0, 0.35)
        sim.run(work)
        return [(r.sent, r.first_token, r.done) for r in sim.records]

    colocated = Deployment("c", colocated=1)
    pd = Deployment("pd", prefill=1, decode=1, local_prefill="off", transport=transport)
    for dep, shared in ((colocated, True), (pd, shares)):
        if shared:
            by_distinct, by_context = simulate(distinct, dep, common), simulate(context, dep, common)
            assert by_distinct.tpot_s["p50"] < by_context.tpot_s["p50"] - 0.003, dep
        else:
            assert times(distinct, dep, common) == times(context, dep, common), dep
        assert times(distinct, dep, apart) == times(context, dep, apart), dep


def test_one_request_alone_costs_what_the_profile_says():
    prof = hand_profile()
    colocated = simulate(prof, Deployment("c", colocated=1), one(100, 5))
    assert colocated.ttft_s["p50"] == pytest.approx(ROUTER_S + FIXED + 100 * PER_TOKEN)
    assert colocated.tpot_s["p50"] == pytest.approx(FIXED + PER_TOKEN)  # a decode step of one sequence
    remote = simulate(prof, Deployment("pd", prefill=1, decode=1, local_prefill="off"), one(100, 5))
    assert remote.ttft_s["p50"] == pytest.approx(ROUTER_S + FIXED + 100 * PER_TOKEN)
    # the second token waits for the hand-off and one decode step; the rest one step each
    assert remote.tpot_s["p50"] == pytest.approx((HANDOFF + 4 * (FIXED + PER_TOKEN)) / 4)
    two_threads = simulate(prof, Deployment("c2", colocated=1, threads=2), one(100, 5))
    assert two_threads.ttft_s["p50"] == pytest.approx(ROUTER_S + FIXED + 100 * PER_TOKEN / 2)
    prof["serving"] = {"fixed_s": 0.002, "per_sequence_s": 0.0005}  # what streaming adds to a decode step
    served = simulate(prof, Deployment("c", colocated=1), one(100, 5))
    assert served.ttft_s["p50"] == colocated.ttft_s["p50"]  # the prefill step streams nothing yet
    assert served.tpot_s["p50"] == pytest.approx(FIXED + PER_TOKEN + 0.002 + 0.0005)
    # `pdserve colocated` serves in the engine's own process, measured apart per thread count
    prof["colocated_serving"] = {"1": {"fixed_s": 0.004, "per_sequence_s": 0.001}}
    alone = simulate(prof, Deployment("c", colocated=1), one(100, 5))
    assert alone.tpot_s["p50"] == pytest.approx(FIXED + PER_TOKEN + 0.004 + 0.001)
    nodes = simulate(prof, Deployment("c", colocated=2), one(100, 5))  # `up --prefill 0 --decode 2`
    assert nodes.tpot_s["p50"] == served.tpot_s["p50"]
    unmeasured = simulate(prof, Deployment("c", colocated=1, threads=2), one(100, 5))  # no "2": the nodes' figure
    assert unmeasured.tpot_s["p50"] == pytest.approx(FIXED + PER_TOKEN / 2 + 0.002 + 0.0005)


def test_a_prefill_nodes_prefills_slow_by_the_share_serving_takes_while_streams_decode():
    prof = hand_profile() | {"prefill_serving": {"fixed": 0.1, "per_sequence": 0.05}}
    off = Deployment("pd", prefill=1, decode=1, local_prefill="off")
    alone = simulate(prof, off, one(100, 5))  # no stream decodes while it prefills: the fixed share
    assert alone.ttft_s["p50"] == pytest.approx(ROUTER_S + (FIXED + 100 * PER_TOKEN) * 1.1)
    assert alone.tpot_s["p50"] == pytest.approx(simulate(hand_profile(), off, one(100, 5)).tpot_s["p50"])  # as before
    assert simulate(prof, Deployment("c", colocated=1), one(100, 5)).ttft_s["p50"] == pytest.approx(
        ROUTER_S + FIXED + 100 * PER_TOKEN
    )  # no prefill node
    sim = Simulation(prof, off, None, None)
    sim.decodes[0].running = [Decoding([1] * 10, 5, lambda *_: None) for _ in range(4)]  # four streams decode
    done = []
    sim.prefills[0].add_prefill(Prefill(list(range(100)), [], lambda now, cached: done.append(now)))
    sim.now, _, step_done = heapq.heappop(sim._events)
    step_done()
    assert done == [pytest.approx((FIXED + 100 * PER_TOKEN) * (1 + 0.1 + 4 * 0.05))]


def test_a_sampled_workload_pays_the_profiles_sampling_per_token_and_a_greedy_one_nothing():
    """The step line is timed greedy; at a temperature each step adds the sampler's cost per token
    it emits: the prompt's first (its prefill step), then one per decoding sequence."""
    prof = hand_profile()
    for engine in prof["engines"].values():
        engine["sampling"] = {"fixed_s": 0.001, "per_row_s": 0.002, "samples": []}
    greedy = one(100, 5)
    sampled = Workload(greedy.items, concurrency=1, temperature=0.7)
    for dep in (Deployment("c", colocated=1), Deployment("pd", prefill=1, decode=1, local_prefill="off")):
        plain, drawn = simulate(prof, dep, greedy), simulate(prof, dep, sampled)
        assert drawn.ttft_s["p50"] == pytest.approx(plain.ttft_s["p50"] + 0.003)
        assert drawn.tpot_s["p50"] == pytest.approx(plain.tpot_s["p50"] + 0.003)
    sim = Simulation(prof, Deployment("c", colocated=1), None, None)
    sim.run(sampled)
    engine = sim.decodes[0]
    assert engine.step_seconds(Step([], [100, 100]), 0) == pytest.approx(FIXED + 2 * PER_TOKEN + 0.001 + 2 * 0.002)
    assert engine.step_seconds(Step([(50, 0), (8, 0)], [100]), 1) == pytest.approx(  # one chunk ends its prompt
        FIXED + 59 * PER_TOKEN + 0.001 + 2 * 0.002
    )
    assert engine.step_seconds(Step([(50, 0)], []), 0) == pytest.approx(FIXED + 50 * PER_TOKEN)  # samples nothing
    del prof["engines"]["1"]["sampling"]  # a profile written before it measured sampling
    assert simulate(prof, Deployment("c", colocated=1), greedy).completed == 1
    with pytest.raises(ValueError, match="the profile has no sampling cost"):
        simulate(prof, Deployment("c", colocated=1), sampled)


def test_a_decode_step_beside_another_engines_decoding_pays_the_profiles_contention():
    """Two engines on the profiled host, both decoding: each decode step costs the contention
    figure times its line; one engine alone, a prefill node beside (it never decodes), a
    deployment over the host's cores or a profile without the figure: the line alone."""
    prof = hand_profile() | {"machine": {"cores": 2}}
    two = Workload([Item([list(range(k, k + 100))], 60) for k in (1, 1000)], concurrency=2)
    alone = Workload(two.items[:1], concurrency=1)
    x2, pd = Deployment("x2", colocated=2), Deployment("pd", prefill=1, decode=1, local_prefill="off")
    before = {d.name: simulate(prof, d, two).tpot_s["p50"] for d in (x2, pd)}
    prof["engines"]["1"]["contention"] = {"decoding": 1.5, "context": 600, "samples": []}
    after = {d.name: simulate(prof, d, two).tpot_s["p50"] for d in (x2, pd)}
    line = FIXED + PER_TOKEN  # a decode step of one sequence
    assert before["x2"] == pytest.approx(line, rel=0.02) and after["x2"] == pytest.approx(1.5 * line, rel=0.02)
    assert after["pd"] == pytest.approx(before["pd"])
    assert simulate(prof, x2, alone).tpot_s["p50"] == pytest.approx(line, rel=0.02)
    prof["machine"]["cores"] = 1  # two one-thread engines: more cores than the profiled host's
    assert simulate(prof, x2, two).tpot_s["p50"] == pytest.approx(before["x2"])
    sim = Simulation(prof | {"machine": {"cores": 2}}, x2, None, None)
    engine = sim.decodes[0]
    assert engine.step_seconds(Step([], [100]), 0, contended=True) == pytest.approx(1.5 * line)
    assert engine.step_seconds(Step([(8, 0)], [100]), 0, contended=True) == pytest.approx(line + 8 * PER_TOKEN)


@pytest.mark.parametrize(
    "deployment, chunked",
    [
        (Deployment("pd", prefill=1, decode=1), True),  # a decode node's default
        (Deployment("pd", prefill=1, decode=1, prefill_tokens_with_decodes=0), False),
        (Deployment("c", colocated=2), True),  # `up --prefill 0 --decode 2`: decode nodes
        (Deployment("c", colocated=1), False),  # `pdserve colocated`: the engine's default
    ],
)
def test_prompts_beside_decodes_go_a_share_a_step_where_the_engine_would_take_one(deployment, chunked):
    sim = Simulation(hand_profile(), deployment, None, None)
    engine, steps, done = sim.decodes[0], [], []
    price = engine.step_seconds
    engine.step_seconds = lambda step, *more, **named: (
        steps.append([n for n, _ in step.prefills]) or price(step, *more, **named)
    )
    engine.running = [Decoding([1] * 10, 50, lambda *_: None)]  # decoding throughout
    engine.add_prefill(Prefill(list(range(100)), [], lambda now, cached: done.append(now)))
    while not done:
        sim.now, _, event = heapq.heappop(sim._events)
        event()
    share = DECODE_NODE_PREFILL_TOKENS
    prefills = [chunks for chunks in steps if chunks]  # (the decode goes on after)
    assert prefills == ([[share]] * (100 // share) + [[100 % share]] if chunked else [[100]])


def test_serving_adds_seconds_per_prompt_on_a_prefill_node_and_in_one_colocated_process():
    """A served prompt costs fixed_s on top of its share, once, in the step its prefill ends;
    `pdserve colocated`'s prefills take what was measured in it; engines behind a router
    (colocated x 2: decode nodes prefilling locally) take nothing the profile did not measure."""
    prof = hand_profile() | {"prefill_serving": {"fixed_s": 0.03, "fixed": 0.1, "per_sequence": 0.0}}
    off = Deployment("pd", prefill=1, decode=1, local_prefill="off")
    line = FIXED + 100 * PER_TOKEN
    assert simulate(prof, off, one(100, 5)).ttft_s["p50"] == pytest.approx(ROUTER_S + line * 1.1 + 0.03)
    chunked = hand_profile() | {"prefill_serving": {"fixed_s": 0.03, "fixed": 0.0, "per_sequence": 0.0}}
    for e in chunked["engines"].values():
        e["max_num_batched_tokens"] = 64  # 100 tokens: two steps, the seconds paid once
    two_steps = FIXED + 64 * PER_TOKEN + FIXED + 36 * PER_TOKEN
    assert simulate(chunked, off, one(100, 5)).ttft_s["p50"] == pytest.approx(ROUTER_S + two_steps + 0.03)
    sim = Simulation(chunked, off, None, None)
    sim.prefills[0].add_prefill(Prefill(list(range(100)), [], lambda *_: None))
    first_step_ends, _, _ = heapq.heappop(sim._events)
    assert first_step_ends == pytest.approx(FIXED + 64 * PER_TOKEN)  # paid in the step the prompt ends
    prof["colocated_prefill_serving"] = {"1": {"fixed_s": 0.02, "fixed": 0.5, "per_sequence": 0.0}}
    alone = simulate(prof, Deployment("c", colocated=1), one(100, 5))
    assert alone.ttft_s["p50"] == pytest.approx(ROUTER_S + line * 1.5 + 0.02)
    assert alone.tpot_s["p50"] == pytest.approx(FIXED + PER_TOKEN)  # decode steps: what "serving" says
    behind_router = simulate(prof, Deployment("c", colocated=2), one(100, 5))
    assert behind_router.ttft_s["p50"] == pytest.approx(ROUTER_S + line)


def test_every_profiled_step_fits_the_engines_caps():
    """A size over the caps would time another step than the one recorded (a mixed step's prompt
    waits for a sequence's slot at max_num_seqs running: the step timed is a decode step)."""
    tokens, seqs = EngineConfig.max_num_batched_tokens, EngineConfig.max_num_seqs
    for grid in [*profiles.GRIDS.values(), profiles.QUICK]:
        assert all(new <= tokens for new, _ in grid["prefill"])
        assert all(batch <= seqs for batch, _ in grid["decode"] + grid["distinct"])
        assert all(batch + 1 <= seqs and batch + chunk <= tokens for batch, _, chunk in grid["mixed"])
    assert profiles.grid("cpu", False) is profiles.GRIDS["cpu"] and profiles.grid("cuda:0", True) is profiles.QUICK


def test_distinct_decode_samples_share_no_block_and_the_others_do(tiny_llama):
    """The profile's decode steps of sequences without a common prefix read each one's own blocks;
    the grid's other steps share their leading blocks (one prefill sets a large batch up)."""
    config = EngineConfig(model=str(tiny_llama), dtype="float32", num_threads=1, kv_cache_bytes=8 << 20)
    prof = profiles.StepProfiler(config, repeat=1)
    for shared in (True, False):
        prof._add_prefilled([48, 48, 48], 4, shared)
        tables = [set(seq.block_table) for seq in prof.llm.scheduler.running]
        assert len(tables) == 3 and all(len(t) >= 3 for t in tables)  # 48 tokens: 3 blocks of 16 at least
        assert bool(tables[0] & tables[1] & tables[2]) is shared
        profiles._run_out(prof.llm)
    assert prof.decode(2, 48, shared=False) > 0 and prof.samples[-1][0].shared == 0
    assert prof.decode(4, 48) > 0 and prof.samples[-1][0].shared == 3 * 32  # 2 blocks held by 4: 3 copies
    assert len(prof.samples[-1][0].decodes) == 4


@pytest.mark.parametrize(
    "share, fixed_s",
    [(0.1, 0.03), (0.0, 0.05), (0.25, 0.0)],
)
def test_a_served_prefills_share_and_seconds_go_through_a_long_prompt_and_a_follow_up(share, fixed_s):
    line = StepModel(0.01, 1e-3, 0.0, 0.0, 0.0, 5e-3)
    alone, follow_up = line.seconds(Step([(600, 0)], [])), line.seconds(Step([(64, 1024)], []))
    prefills = [(0, alone * (1 + share) + fixed_s)] * 2 + [(4, alone * (1 + share + 4 * 0.02) + fixed_s)] * 2
    fit = profiles.prefill_serving(prefills, [follow_up * (1 + share) + fixed_s] * 3, line, 600, (64, 1024))
    assert (fit["fixed"], fit["fixed_s"]) == (pytest.approx(share, abs=1e-9), pytest.approx(fixed_s, abs=1e-9))
    assert fit["per_sequence"] == pytest.approx(0.02)
    # a long prompt served faster than its line, a follow-up slower: a negative share; seconds alone, fitted to both
    fast_long = profiles.prefill_serving([(0, alone - 0.01)], [follow_up + 0.04], line, 600, (64, 1024))
    assert (fast_long["fixed"], fast_long["fixed_s"]) == (0.0, pytest.approx(0.015))
    # the other way round: negative seconds; a share alone, fitted to both
    slow_long = profiles.prefill_serving([(0, alone * 1.3)], [follow_up * 1.1], line, 600, (64, 1024))
    assert (slow_long["fixed"], slow_long["fixed_s"]) == (pytest.approx(0.2), 0.0)


def test_a_closed_loop_keeps_its_concurrency_and_every_request_ends():
    rep = simulate(
        hand_profile(), Deployment("pd", prefill=1, decode=1), synthetic(40, "uniform:50:300", "8", concurrency=6)
    )
    assert rep.completed == rep.num_requests == 40
    assert rep.max_concurrency == 6
    assert sum(rep.extra["utilization"].values()) > 0


def test_the_simulator_runs_the_routers_own_placement_and_pool(monkeypatch):
    calls = {"decide": 0, "pick": 0}
    decide, pick = router.placement.Placement.decide, router.pool.EndpointPool.pick

    def counted_decide(self, *a, **k):
        calls["decide"] += 1
        d = decide(self, *a, **k)
        d.local = True  # the router's answer is what the simulator follows
        return d

    def counted_pick(self, *a, **k):
        calls["pick"] += 1
        return pick(self, *a, **k)

    monkeypatch.setattr(router.placement.Placement, "decide", counted_decide)
    monkeypatch.setattr(router.pool.EndpointPool, "pick", counted_pick)
    rep = simulate(hand_profile(), Deployment("pd", prefill=1, decode=2), synthetic(10, "100", "4", concurrency=2))
    assert calls["decide"] == 10 and calls["pick"] == 20  # a decode node and a prefill node each
    assert rep.local_prefill_rate == 1.0


def test_the_simulator_holds_a_local_prefill_behind_another_as_the_router_does(monkeypatch):
    """Late binding (router/placement.py): the anchor's prompts, 8 in flight. Some go to the decode
    node, never two there at once while a prefill node could take them: a held request is placed
    again when a prefill ends, and every request ends."""
    most, decided = {}, []
    prefill, decide = router.pool.Endpoint.prefill, router.placement.Placement.decide

    @contextlib.contextmanager
    def counted_prefill(self, tokens):
        with prefill(self, tokens) as alone:
            most[self.address] = max(most.get(self.address, 0), self.prefilling)
            yield alone

    def counted_decide(self, *a, **k):
        decided.append(decide(self, *a, **k))
        return decided[-1]

    monkeypatch.setattr(router.pool.Endpoint, "prefill", counted_prefill)
    monkeypatch.setattr(router.placement.Placement, "decide", counted_decide)
    rep = simulate(hand_profile(), Deployment("pd", prefill=1, decode=1), synthetic(32, "610", "64", concurrency=8))
    assert rep.completed == 32 and rep.local_prefill_rate > 0
    assert most == {"prefill-0": 8, "decode-0": 1}
    assert any(d.hold for d in decided) and len(decided) == 32 + sum(d.hold for d in decided)


def test_the_simulator_measures_token_gaps_and_runs_the_tpot_bound_as_the_router_does(monkeypatch):
    """A decode node's token gaps are its steps' seconds, from its first token on (the router
    measures from a stream's first decode message); under max_local_prefill_tpot no local prefill
    starts beside sequences decoding while the gaps are over it, so fewer start than without."""
    sim = Simulation(hand_profile(), Deployment("pd", prefill=1, decode=1), None, None)
    sim.run(one(100, 5))  # the prefill node's token, then 4 decode steps of one sequence: 3 gaps
    assert [s for s, _ in sim.decodes[0].endpoint.token_gaps.gaps] == pytest.approx([FIXED + PER_TOKEN] * 3)

    decided, decide = [], router.placement.Placement.decide

    def counted_decide(self, *a, **k):
        decided.append((decide(self, *a, **k), k["decode_running"]))
        return decided[-1][0]

    monkeypatch.setattr(router.placement.Placement, "decide", counted_decide)
    anchor = synthetic(32, "610", "64", concurrency=8)
    free = simulate(hand_profile(), Deployment("pd", prefill=1, decode=1), anchor)
    decided.clear()
    # decode steps of 8 sequences take 18 ms, 50 ms beside a 32-token chunk of a local prefill
    bounded = simulate(hand_profile(), Deployment("pd", prefill=1, decode=1, max_local_tpot=0.03), anchor)
    assert bounded.completed == 32 and bounded.local_prefill_rate > 0
    assert bounded.tpot_s["p95"] < 0.9 * free.tpot_s["p95"]  # (here 23.5 ms against 27.4)
    over = [d for d, running in decided if running and d.decode_tpot_s is not None and d.decode_tpot_s > 0.03]
    assert over and not any(d.local for d in over)
    assert "none while TPOT > 30 ms" in Deployment("pd", prefill=1, decode=1, max_local_tpot=0.03).describe()


def test_follow_ups_hit_the_cache_of_the_node_holding_their_history():
    chat = Workload(
        [Item([list(range(1000 * c + 1, 1000 * c + 200)), [5] * 30, [6] * 30], 16) for c in range(4)], concurrency=2
    )
    auto = simulate(hand_profile(), Deployment("pd", prefill=1, decode=2), chat)
    off = simulate(hand_profile(), Deployment("pd", prefill=1, decode=2, local_prefill="off"), chat)
    assert off.local_prefill_rate == 0.0
    assert auto.local_prefill_rate > 0  # short uncached suffixes computed where the history is
    assert auto.prefix_cache_hit_rate > off.prefix_cache_hit_rate > 0  # the prefill node lacks the answers


def test_prefills_on_one_prefix_arriving_together_compute_it_once_as_the_engine_does():
    """Four prompts on one uncached 96-token prefix reach an engine in the same instant (as the
    engine's scheduler, tests/test_scheduler.py): the first computes it, the others wait for it
    and take its blocks; an unrelated prompt goes ahead meanwhile."""
    sim = Simulation(hand_profile(), Deployment("c", colocated=1), None, None)
    engine, done = sim.decodes[0], {}
    prefix = list(range(1, 97))
    prompts = {f"r{i}": prefix + [500 + i] * 20 for i in range(4)} | {"other": list(range(900, 1000))}
    engine.stepping = True  # the arrivals queue up behind a step in flight
    for rid, tokens in prompts.items():
        on_done = lambda now, cached, rid=rid: done.setdefault(rid, (now, cached))  # noqa: E731
        engine.add_prefill(Prefill(tokens, router.pool.block_hashes(tokens[:-1], 16), on_done))
    engine.stepping = False
    engine.kick()
    while sim._events:
        sim.now, _, fn = heapq.heappop(sim._events)
        fn()
    assert {rid: cached for rid, (_, cached) in done.items()} == {"r0": 0, "r1": 96, "r2": 96, "r3": 96, "other": 0}
    assert done["other"][0] == done["r0"][0] < done["r1"][0]  # in the first step, beside r0


def test_prompts_sent_together_make_an_idle_engines_first_step_in_numbers_the_timing_seed_draws():
    """Eight prompts sent at once to one idle engine: on time, the first alone makes the first
    step (it starts at once); with a timing seed, arrivals and the engine's start are late by up
    to ARRIVAL_JITTER_S and the first step holds a varying number of them, the same for a seed."""
    work = synthetic(8, "100", "4", concurrency=8)  # 100-token prompts: 0.11 s steps, far past the jitter
    dep = Deployment("c", colocated=1)

    def first_step(rep_seed):
        sim = Simulation(hand_profile(), dep, None, None, timing_seed=rep_seed)
        rep = sim.run(work)
        assert rep.completed == 8
        firsts = sorted(r.first_token for r in sim.records)
        return sum(t == firsts[0] for t in firsts), [(r.sent, r.first_token, r.done) for r in sim.records]

    assert first_step(None)[0] == 1
    counts = [first_step(seed)[0] for seed in range(20)]
    assert len(set(counts)) > 1, counts
    assert first_step(3) == first_step(3)
    on_time, late = (
        simulate(hand_profile(), dep, one(100, 4)),
        simulate(hand_profile(), dep, one(100, 4), timing_seed=0),
    )
    assert on_time.ttft_s["p50"] < late.ttft_s["p50"] <= on_time.ttft_s["p50"] + 2 * ARRIVAL_JITTER_S
    spread = timing_spread([simulate(hand_profile(), dep, work, timing_seed=s) for s in range(5)])
    assert spread["ttft_p50_s"]["min"] < spread["ttft_p50_s"]["max"]


def test_an_idle_engine_wakes_once_for_work_arriving_together_then_steps_on_without_waking():
    """Two prompts arrive at one instant: the first's kick draws the engine's wake-up (4 ms),
    the second's draws nothing (the engine is already waking); the first prompt's second chunk
    starts the moment the first step ends (the engine's loop does not sleep between steps)."""
    sim = Simulation(hand_profile(), Deployment("c", colocated=1), None, None, timing_seed=0)
    delays = [0.004, 0.001]
    sim.late = lambda: delays.pop(0) if delays else 0.003
    engine, starts, ends = sim.decodes[0], [], []
    step, step_done = engine._step, engine._step_done

    def counted_step():
        idle = not engine.stepping
        step()
        if idle and engine.stepping:
            starts.append(sim.now)

    def counted_done(*a):
        ends.append(sim.now)
        step_done(*a)

    engine._step, engine._step_done = counted_step, counted_done
    for tokens in (list(range(1, 5001)), list(range(6000, 6100))):  # 5,000 tokens: two chunks of the 4,096 budget
        engine.add_prefill(Prefill(tokens, router.pool.block_hashes(tokens[:-1], 16), lambda now, cached: None))
    while sim._events:
        sim.now, _, fn = heapq.heappop(sim._events)
        fn()
    assert starts[0] == 0.004 and delays == [0.001]
    assert len(starts) == len(ends) == 2 and starts[1] == ends[0]


def test_best_meets_the_slos_with_the_most_goodput_and_its_command_parses():
    prof = hand_profile(per_context=0.01)
    work = synthetic(24, "uniform:400:800", "32", concurrency=8)
    ranked = search.rank(prof, work, budget=2, slo_ttft=5.0, slo_tpot=0.2)
    assert {s.deployment.cores for s in ranked} <= {1, 2}
    assert len(ranked) == len(search.candidates(2, [1, 2], slo_tpot=0.2))
    best = ranked[0]
    assert best.meets and all(best.report.goodput_tps >= (1 - search.TIE) * s.report.goodput_tps for s in ranked)
    local = [s.deployment for s in ranked if s.deployment.prefill and s.deployment.local_prefill == "auto"]
    assert {d.prefill_tokens_with_decodes for d in local} == set(search.BESIDE)  # the share beside decodes
    assert {d.max_local_tpot for d in local} == {None, 0.15, 0.18}  # no bound, and TPOT_BOUNDS of the SLO
    assert {d.max_local_tokens for d in local if d.max_local_tpot} == {router.placement.MAX_LOCAL_TOKENS}
    for s in ranked:
        cmd = shlex.split(search.command(s.deployment))
        assert cmd[0] == "pdserve"
        args = parser().parse_args(cmd[1:])  # every command it may print is one pdserve takes
        assert getattr(args, "prefill_tokens_with_decodes", None) == s.deployment.prefill_tokens_with_decodes
        assert getattr(args, "max_local_prefill_tpot", None) == s.deployment.max_local_tpot


def test_deployments_that_tie_on_goodput_are_ranked_by_cores_then_headroom_and_the_best_says_why(tmp_path, capsys):
    """An open loop every deployment serves: goodputs tie (within TIE), so the fewest cores, then
    the most headroom under the SLOs, win; the command prints why."""
    prof = hand_profile(per_context=0.01)
    work = synthetic(12, "uniform:200:400", "16", rate=0.5)
    ranked = search.rank(prof, work, budget=2, slo_ttft=5.0, slo_tpot=0.2)
    lead = max(s.report.goodput_tps for s in ranked if s.meets)
    tied = [s for s in ranked if s.meets and s.report.goodput_tps >= (1 - search.TIE) * lead]
    assert len(tied) > 1 and ranked[: len(tied)] == tied and ranked[0].tied == len(tied) - 1
    fewest = min(s.deployment.spends for s in tied)
    assert ranked[0].deployment.spends == fewest
    assert ranked[0].headroom == max(s.headroom for s in tied if s.deployment.spends == fewest) > 1
    rep = ranked[0].report
    assert ranked[0].headroom == pytest.approx(min(5.0 / rep.ttft_s["p95"], 0.2 / rep.tpot_s["p95"]))
    missed = search.rank(prof, work, budget=2, slo_ttft=1e-3, slo_tpot=0.2)  # none meets: the closest miss
    assert not any(s.meets for s in missed) and all(s.report.goodput_tps == 0 for s in missed)
    assert missed[0].tied == len(missed) - 1 and missed[0].headroom == max(s.headroom for s in missed)
    from pdserve.plan.cli import main

    path = tmp_path / "p.json"
    profile_file.write(prof, path)
    args = ["plan", "best", "--profile", str(path), "--cores", "2", "--slo-ttft", "5", "--slo-tpot", "0.2"]
    assert (
        main(
            parser().parse_args(
                [*args, "--num-requests", "12", "--prompt-len", "uniform:200:400"]
                + ["--output-len", "16", "--rate", "0.5"]
            )
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"why: {len(tied)} deployments tie on goodput (within 2% of the highest): of those it spends" in out


def gpu_profile() -> dict:
    """A GPU's profile: engines of one host thread, KV handed over TCP (no shared memory)."""
    prof = hand_profile()
    return prof | {
        "engines": {"1": prof["engines"]["1"]},
        "handoff": {"tcp": prof["handoff"]["shm"], "grpc": prof["handoff"]["shm"]},
        "machine": {"gpu": "a GPU"},
    }


def test_a_gpu_budget_spends_one_gpu_an_engine_over_tcp_and_its_commands_parse():
    prof = gpu_profile()
    assert search.on_gpu(prof) and not search.on_gpu(hand_profile())
    assert search.default_transport(prof) == "tcp" and search.default_transport(hand_profile()) == "shm"
    work = synthetic(16, "uniform:400:800", "16", concurrency=8)
    ranked = search.rank(prof, work, 3, slo_ttft=5.0, slo_tpot=0.2, transport="tcp", gpu=True)
    assert len(ranked) == len(search.candidates(3, [1], "tcp", gpu=True, slo_tpot=0.2))
    assert {s.deployment.spends for s in ranked} == {1, 2, 3}  # GPUs, one an engine
    assert {(s.deployment.prefill, s.deployment.decode) for s in ranked if not s.deployment.colocated} == {
        (1, 1),
        (1, 2),
        (2, 1),
    }
    assert all(s.deployment.gpu and s.report.extra["gpus"] == s.deployment.spends for s in ranked)
    grpc = search.command(Deployment("g", prefill=1, decode=1, transport="grpc", gpu=True))
    assert grpc.endswith(" --kv-transport grpc --local-prefill auto --max-local-prefill-tokens 1024")
    assert "--kv-transport" not in search.command(Deployment("s", prefill=1, decode=1, transport="shm"))
    parser().parse_args(shlex.split(grpc)[1:])
    for s in ranked:
        cmd = shlex.split(search.command(s.deployment))
        assert "--device" in cmd and "--num-threads" not in cmd and "--pin-cpus" not in cmd
        assert ("--pin-gpus" in cmd) == (cmd[1] == "up")
        parser().parse_args(cmd[1:])


@pytest.mark.parametrize(
    "budget, gpu_profile_given, says",
    [
        (
            ["--gpus", "2"],
            False,
            "--gpus needs a profile measured on a GPU; {path} was measured on CPU cores (use --cores)",
        ),
        (
            ["--cores", "2"],
            True,
            "--cores needs a profile measured on CPU cores; {path} was measured on a GPU (use --gpus)",
        ),
        (["--gpus", "0"], True, "--gpus must be >= 1, got 0"),
        (["--cores", "2", "--gpus", "2"], False, "argument --gpus: not allowed with argument --cores"),
    ],
)
def test_the_budget_must_match_the_profile(tmp_path, budget, gpu_profile_given, says):
    path = tmp_path / "p.json"
    profile_file.write(gpu_profile() if gpu_profile_given else hand_profile(), path)
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "plan", "best", "--profile", str(path), *budget],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode != 0 and says.format(path=path) in done.stderr, done.stderr


def test_profile_simulate_and_best_end_to_end(tiny_llama, tmp_path):
    out = tmp_path / "profile.json"
    run = [sys.executable, "-m", "pdserve", "plan"]
    done = subprocess.run(
        run
        + ["profile", "--model", str(tiny_llama), "--dtype", "float32", "--threads", "1", "--repeat", "2"]
        + ["--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    prof = profile_file.load(out)
    assert {"shm", "tcp", "grpc"} <= set(prof["handoff"])
    # the decode steps of 1 and 2 streams (twice each, 48 tokens), as the decode node logged them
    assert {b for b, _ in prof["serving"]["samples"]} == {1, 2} and len(prof["serving"]["samples"]) >= 4 * 40
    # before each run, 6 unserved steps of as many sequences in the profiler's own engine
    assert sorted({b for b, *_ in prof["serving"]["reference"]}) == [1, 2] and len(prof["serving"]["reference"]) == 24
    assert len(prof["serving"]["line_samples"]) == len(prof["serving"]["samples"])
    colocated_steps = prof["colocated_serving"]["1"]["samples"]  # `pdserve colocated --num-threads 1`'s
    assert {b for b, _ in colocated_steps} == {1, 2} and len(colocated_steps) >= 4 * 40
    share = prof["prefill_serving"]  # a prefill beside 0, 1 and 2 streams, twice each, and two follow-ups
    assert sorted(b for b, seconds in share["samples"] if seconds > 0) == [0, 0, 1, 1, 2, 2]
    assert share["follow_up"] == [16, 16] and len([s for s in share["follow_up_samples"] if s > 0]) == 2
    colocated = prof["colocated_prefill_serving"]["1"]  # in `pdserve colocated`: alone only
    assert sorted(b for b, _ in colocated["samples"]) == [0, 0] and len(colocated["follow_up_samples"]) == 2
    engine = prof["engines"]["1"]
    assert engine["dtype"] == "float32" and engine["step"]["fixed"] > 0 and len(engine["samples"]) >= 8
    assert isinstance(engine["decode_kernel"], bool)  # which attention path the steps were timed through
    # the sampler at temperature 1 over greedy, 1 and 4 rows, twice each
    assert [n for n, _ in engine["sampling"]["samples"]] == [1, 1, 4, 4] and engine["sampling"]["per_row_s"] >= 0
    # a decode step alone and beside a second engine decoding on the other core, one round (one core: none)
    contention = engine["contention"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert len(contention["samples"]) == 1 and contention["decoding"] > 0 and contention["context"] == 16
    else:
        assert contention is None
    # the decode grid in two passes, the second reversed: 3 steps a shape each time (mixed: --repeat)
    one_pass = [(1, False)] * 3 + [(2, False)] * 3 + [(4, False)] * 3 + [(2, True)] * 2
    timed = [(len(s["decodes"]), bool(s["prefills"])) for s in engine["samples"] if s["decodes"]]
    assert timed == one_pass + one_pass[::-1]
    workload = ["--profile", str(out), "--num-requests", "8", "--prompt-len", "40", "--output-len", "6", "--json"]
    sim = subprocess.run(
        run + ["simulate", *workload, "--prefill", "1", "--decode", "1"], capture_output=True, text=True, cwd=ROOT
    )
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["completed"] == 8
    drawn = subprocess.run(
        run + ["simulate", *workload, "--colocated", "1", "--temperature", "0.8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert drawn.returncode == 0 and json.loads(drawn.stdout)["completed"] == 8, drawn.stderr
    seeds = subprocess.run(
        run + ["simulate", *workload, "--colocated", "1", "--timing-seeds", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert seeds.returncode == 0, seeds.stderr
    spread = json.loads(seeds.stdout)
    assert [r["completed"] for r in spread["runs"]] == [8, 8, 8]
    on_time = json.loads(
        subprocess.run(
            run + ["simulate", *workload, "--colocated", "1"], capture_output=True, text=True, cwd=ROOT
        ).stdout
    )["ttft_s"]["p50"]
    late = [r["ttft_s"]["p50"] for r in spread["runs"]]  # each seed's own draws, none on time
    assert len({*late, on_time}) == 4, (on_time, late)
    best = subprocess.run(
        run + ["best", *workload, "--cores", "2", "--slo-ttft", "10"], capture_output=True, text=True, cwd=ROOT
    )
    assert best.returncode == 0, best.stderr
    top = json.loads(best.stdout)
    assert len(top) == 2 and top[0]["meets_slos"] and top[0]["command"].startswith("pdserve ")


def test_simulate_over_timing_seeds_prints_each_figures_median_and_range(tmp_path, capsys):
    from pdserve.plan.cli import main

    path = tmp_path / "p.json"
    profile_file.write(hand_profile(), path)
    args = parser().parse_args(
        ["plan", "simulate", "--profile", str(path), "--colocated", "1", "--timing-seeds", "4"]
        + ["--num-requests", "8", "--prompt-len", "100", "--output-len", "4"]
    )
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "1 colocated x 1 thread(s): over 4 arrival timings (seeds 0-3), median [min - max]"
    assert [line.split()[0] for line in lines[1:]] == [
        "goodput_tps",
        "ttft_p50_s",
        "ttft_p95_s",
        "tpot_p50_s",
        "tpot_p95_s",
    ]


def test_simulate_takes_the_routers_placement_options_and_the_engines(tmp_path, monkeypatch, capsys):
    """plan simulate's placement flags are the router's and the engine's own (declared once), and
    reach the simulated deployment; plan best leaves out a bound a tiny TPOT SLO rounds to 0."""
    from pdserve.plan import cli

    path = tmp_path / "p.json"
    profile_file.write(hand_profile(), path)
    seen = []
    monkeypatch.setattr(cli, "simulate", lambda prof, dep, *a: seen.append(dep) or simulate(prof, dep, *a))
    flags = ["--max-local-prefill-tpot", "0.05", "--no-late-binding", "--max-local-prefill-tokens", "256"]
    flags += ["--prefill-tokens-with-decodes", "8", "--num-requests", "2", "--prompt-len", "50", "--json"]
    assert cli.main(parser().parse_args(["plan", "simulate", "--profile", str(path), *flags])) == 0
    dep = seen[0]
    assert (dep.local_prefill, dep.max_local_tpot, dep.late_binding, dep.max_local_tokens) == ("auto", 0.05, False, 256)
    assert dep.prefill_tokens_with_decodes == 8 and json.loads(capsys.readouterr().out)["completed"] == 2
    assert {d.max_local_tpot for d in search.candidates(2, [1], slo_tpot=1e-5)} == {None}


@pytest.mark.parametrize(
    "args, says",
    [
        (["simulate", "--profile", "/nonexistent/p.json"], "/nonexistent/p.json: No such file"),
        (["simulate", "--threads", "4"], "the profile has engines of ['1', '2'] threads, not 4"),
        (["simulate", "--transport", "rdma"], "the profile measured no 'rdma' hand-off"),
        (["best", "--cores", "2", "--num-requests", "0"], "--num-requests must be >= 1, got 0"),
        (["profile", "--threads", "0", "--out", "x.json"], "--threads must list thread counts >= 1"),
        (["simulate", "--timing-seeds", "-1"], "--timing-seeds must be >= 0, got -1"),
        (["simulate", "--temperature", "-1"], "the temperature must be >= 0, got -1.0"),
        (["best", "--cores", "2", "--temperature", "1"], "the profile has no sampling cost"),
        (["simulate", "--prefill-tokens-with-decodes", "-1"], "prefill_tokens_with_decodes must be >= 0, got -1"),
        (
            ["simulate", "--max-local-prefill-tpot", "0"],
            "max_local_prefill_tpot must be > 0 seconds and finite, got 0.0",
        ),
    ],
)
def test_bad_input_is_one_line_naming_it(tmp_path, args, says):
    path = tmp_path / "p.json"
    profile_file.write(hand_profile(), path)
    if "--profile" not in args and args[0] != "profile":
        args = [*args, "--profile", str(path)]
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "plan", *args], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_servings_fit_leaves_out_the_few_steps_between_the_stream_counts():
    """Served decode steps of 1, 4 and 8 streams (100 each) cost 2 ms + 1 ms a sequence over the
    line; a step of 6 sequences as streams start or finish, at 50 ms, carries no weight."""
    from pdserve.plan.profile import serving_fit

    extra = [(n, 0.002 + 0.001 * n) for n in (1, 4, 8) for _ in range(100)] + [(6, 0.050)]
    fit = serving_fit(extra)
    assert fit["fixed_s"] == pytest.approx(0.002) and fit["per_sequence_s"] == pytest.approx(0.001)
    assert len(fit["samples"]) == 301


def test_serving_is_priced_over_the_unserved_steps_of_its_window():
    """Served steps 10 ms over the step line, and unserved ones of as many sequences timed just
    before them 7 ms over it (the machine slower than when the line's samples were taken):
    serving adds 3 ms a step, not 10."""
    from pdserve.plan.profile import serving_overhead

    line = StepModel(fixed=0.02, per_token=0.0, per_pair=0.0, per_context=0.001, per_sequence=0.0)

    def steps(n, over):
        contexts = [600] * n
        return [[n, line.seconds(Step([], contexts)) + over, contexts, 0] for _ in range(20)]

    served = {"steps": steps(1, 0.010) + steps(4, 0.010), "reference": steps(1, 0.007) + steps(4, 0.007), "tpots": []}
    fit = serving_overhead(served, line)
    assert fit["fixed_s"] == pytest.approx(0.003) and fit["per_sequence_s"] == pytest.approx(0.0, abs=1e-12)
    assert [x for _, x in fit["line_samples"]] == pytest.approx([0.010] * 40)
    alone = serving_overhead({"steps": served["steps"], "tpots": []}, line)  # no reference (a GPU): the line's
    assert alone["fixed_s"] == pytest.approx(0.010)


def test_a_served_batch_size_with_no_reference_takes_the_nearest_ones_drift():
    from pdserve.plan.profile import less_drift

    reference = [(4, 0.002), (4, 0.004), (4, 0.003), (8, 0.004)]  # medians: 3 ms at 4, 4 ms at 8
    served = [(7, 0.010), (2, 0.010), (6, 0.010), (8, 0.010)]  # 6: as far from 4 as from 8, takes 4's
    priced = less_drift(served, reference)
    assert [n for n, _ in priced] == [7, 2, 6, 8] and [x for _, x in priced] == pytest.approx(
        [0.006, 0.007, 0.007, 0.006]
    )
    assert less_drift(served, []) == served


def test_the_profiles_served_requests_decode_greedily_as_its_steps_and_the_bench_do():
    """The protocol's default samples at temperature 1; the profile's requests ask for greedy
    decoding, as its grid's steps and `pdserve bench` (its default) decode: sampled, the served
    steps carried the sampler's cost into what serving adds."""
    import asyncio

    asked = []

    class Recording:  # the client's stream call, recorded (one finished message)
        async def stream(self, prompt, **sampling):
            asked.append(sampling)
            yield type("Part", (), {"finished": True, "timings": None})()

    asyncio.run(profiles._streams(Recording(), [[1, 2, 3]], 4))
    assert asked == [{"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}]
    assert parser().parse_args(["bench", "--addr", "x"]).temperature == asked[0]["temperature"]
    assert profiles.StepProfiler._params(None, 4).temperature == 0.0
