"""Conditional disaggregation: the router's choice between the prefill pool and a local prefill on
the decode node (router/placement.py), and the decode node's local prefill path, end to end."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from cluster import local_cluster, wait_for_no_blocks
from conftest import engine_alone, make_engine, run_to_completion

import router.server
from engine import SamplingParams
from pdserve_api import nodes_pb2, nodes_pb2_grpc
from router.client import AsyncClient, build_request
from router.frontend import RequestError
from router.placement import LinearFit, Placement
from router.pool import TOKEN_GAPS, TokenGaps

SYSTEM = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39]


def test_linear_fit_recovers_fixed_and_per_token_cost():
    fit = LinearFit()
    for n in (10, 50, 100, 400):
        fit.add(n, 0.03 + 0.001 * n)
    fixed, per_token = fit.line()
    assert fixed == pytest.approx(0.03) and per_token == pytest.approx(0.001)
    one_size = LinearFit()
    one_size.add(100, 0.2)
    assert one_size.line() == (0.0, pytest.approx(0.002)) and one_size.seconds(50) == pytest.approx(0.1)
    # sizes close together (the anchor's 590-630-token prompts) and noisy times: a free line's
    # slope would be the noise's (here 0.41 s + 1.6 ms a token against 2 ms); the prior's slope, or
    # proportional, stands instead
    close = LinearFit()
    for n, s in ((590, 1.40), (630, 1.432), (600, 1.35), (620, 1.45)):
        close.add(n, s)
    assert close.line(slope_prior=0.002) == (pytest.approx(1.408 - 0.002 * 610), 0.002)
    assert close.line() == (0.0, pytest.approx(1.408 / 610))
    # sizes spanning 2x whose line would cross below 0 (steeper than proportional): proportional,
    # its own slope, not the prior's
    steep = LinearFit()
    for n, s in ((100, 0.1), (200, 0.5)):
        steep.add(n, s)
    assert steep.line(slope_prior=0.001) == (0.0, pytest.approx(0.6 / 300))


def measured(**kwargs) -> Placement:
    p = Placement(**kwargs)
    for n in (100, 500, 1000):  # the prefill pool: 30 ms + 1 ms a token
        p.measured_remote(n, 0.03 + 0.001 * n, transfer_s=n * 1e-5, moved=n, handoff_s=0.005, alone=True)
    return p


def test_nothing_measured_goes_remote_and_a_short_suffix_the_decode_node_caches_goes_local():
    assert not Placement().decide(1000, decode_cached=992, prefill_cached=992, moved=1000).local
    p = measured()
    d = p.decide(1000, decode_cached=992, prefill_cached=992, moved=1000)  # a chat follow-up
    assert d.local and d.local_tokens == 8 and d.local_s < d.remote_s
    # the decode node holds nothing but the prefill node does: computing 1000 tokens here loses
    assert not p.decide(1000, decode_cached=0, prefill_cached=992, moved=1000).local
    # both hold 600 tokens: an idle decode node computes the 400 sooner (no hop, no transfer), but
    # with 4 sequences decoding there each would wait for them: the prefill pool,
    assert p.decide(1000, decode_cached=600, prefill_cached=600, moved=1000).local
    assert not p.decide(1000, decode_cached=600, prefill_cached=600, moved=1000, decode_running=4).local
    # unless 3000 tokens queue on the prefill node ahead of it
    assert p.decide(1000, 600, 600, moved=1000, decode_running=4, prefill_queued=3000).local
    # a follow-up's 8 tokens: local beside one decoding sequence; beside 8 the 8 ms they add to each
    # one's step outweigh the remote way's hop and 10 ms transfer, unless the link is slow
    assert p.decide(1000, decode_cached=992, prefill_cached=992, moved=1000, decode_running=1).local
    assert not p.decide(1000, decode_cached=992, prefill_cached=992, moved=1000, decode_running=8).local
    p.link_s_per_token = 1e-4  # 23 KB a token at 0.23 GB/s
    assert p.decide(1000, decode_cached=992, prefill_cached=992, moved=1000, decode_running=8).local
    # local prefills queued on the decode node push it back
    assert not p.decide(1000, decode_cached=992, prefill_cached=992, moved=1000, local_queued=3000).local
    p.link_s_per_token = 1e-5


def test_the_cap_and_the_modes():
    p = measured(max_local_tokens=100)
    assert not p.decide(1000, decode_cached=0, prefill_cached=0, moved=1000, prefill_queued=10**6).local
    assert measured(mode="always").decide(1000, 0, 1000, moved=1000).local
    assert not measured(mode="off").decide(1000, 999, 0, moved=1000).local
    with pytest.raises(ValueError, match="local prefill mode must be one of"):
        Placement(mode="sometimes")
    with pytest.raises(ValueError, match="max_local_prefill_tokens must be >= 0"):
        Placement(max_local_tokens=-1)


def test_a_tpot_bound_keeps_local_prefills_off_a_decode_node_whose_tokens_are_further_apart():
    """max_local_prefill_tpot: over the bound, remote; at or under it, as without; with nobody
    decoding there, or nothing measured, the bound has no one to protect."""
    follow_up = dict(num_tokens=1000, decode_cached=992, prefill_cached=992, moved=1000, decode_running=1)
    assert measured().decide(**follow_up, decode_tpot_s=0.5).local  # no bound
    p = measured(max_local_tpot_s=0.05)
    over = p.decide(**follow_up, decode_tpot_s=0.06)
    assert not over.local and over.decode_tpot_s == 0.06 and over.remote_s is None
    assert p.decide(**follow_up, decode_tpot_s=0.05).local
    assert p.decide(**follow_up).local  # nothing measured yet
    assert p.decide(**{**follow_up, "decode_running": 0}, decode_tpot_s=0.06).local
    assert measured(mode="always", max_local_tpot_s=0.05).decide(**follow_up, decode_tpot_s=0.06).local
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"max_local_prefill_tpot must be > 0 seconds and finite, got {bad}"):
            Placement(max_local_tpot_s=bad)


def test_token_gaps_are_seconds_over_tokens_over_the_last_few():
    gaps = TokenGaps()
    assert gaps.tpot_s is None
    gaps.add(0.3, tokens=3)  # a speculative step's three tokens in one message
    gaps.add(0.2)
    gaps.add(1.0, tokens=0)  # no tokens (a final message): not a gap
    assert gaps.tpot_s == pytest.approx(0.5 / 4)  # seconds over tokens, as a request's TPOT
    for _ in range(TOKEN_GAPS):
        gaps.add(0.01)
    assert gaps.tpot_s == pytest.approx(0.01)


def test_a_local_prefill_behind_another_there_is_held_to_be_placed_again():
    """Late binding: local, but the decode node computes another local prefill: hold (the router
    decides again when a prefill ends); not when the node is free, the choice is remote, or the
    mode is not auto."""
    p = measured()
    queued = dict(prefill_queued=10**5)  # 100 s of prompts on the prefill node: local wins
    assert not p.decide(1000, 600, 600, moved=1000, **queued).hold
    d = p.decide(1000, 600, 600, moved=1000, local_queued=500, **queued)
    assert d.local and d.hold
    assert not p.decide(1000, 600, 600, moved=1000, local_queued=500).hold  # remote: bound now
    assert not measured(mode="always").decide(1000, 600, 600, moved=1000, local_queued=500, **queued).hold
    unheld = measured(late_binding=False).decide(1000, 600, 600, moved=1000, local_queued=500, **queued)
    assert unheld.local and not unheld.hold  # --no-late-binding: bound on arrival


def test_with_no_prefill_node_to_take_it_a_prefill_is_local_at_once_unless_local_prefill_is_off():
    """No healthy prefill node: held or too long for local, the decode node computes it now (no
    hold: no prefill node would free); with local prefill off it stays remote (the router retries)."""
    for p in (Placement(), measured()):  # nothing measured yet, or measured
        d = p.decide(5000, 0, 0, moved=5000, local_queued=500, prefill_node=False)
        assert d.local and not d.hold
    assert not measured(mode="off").decide(1000, 999, 0, moved=1000, prefill_node=False).local


def test_the_local_measurement_replaces_the_prefill_pools_once_there_is_one():
    p = measured()
    before = p.decide(1000, 900, 900, moved=1000).local_s
    p.measured_local(100, 5.0, alone=True)  # a slow decode node
    after = p.decide(1000, 900, 900, moved=1000)
    assert after.local_s > before and not after.local
    p.measured_local(100, 50.0, alone=False)  # not alone: queueing, not compute; not learned
    assert p.local.samples[-1] == (100, 5.0)


async def chat(router, first: list[int], turns: int = 4, between=lambda: None) -> tuple[list[int], list[dict]]:
    history, timings = list(first), []
    async with AsyncClient(router.address) as client:
        for turn in range(turns):
            if turn:
                between()
            history += [100 + turn, 7]
            result = await client.generate(history, max_tokens=6, temperature=0, ignore_eos=True)
            timings.append(result.timings)
            history += result.token_ids
    return history, timings


def engine_chat(model, first: list[int], turns: int = 4) -> list[int]:
    engine = make_engine(model, enable_prefix_caching=False)
    history = list(first)
    for turn in range(turns):
        history += [100 + turn, 7]
        engine.add_request(f"t{turn}", list(history), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        history += run_to_completion(engine)[f"t{turn}"].token_ids
    return history


def test_follow_ups_prefill_on_the_decode_node_from_its_cache_with_the_same_tokens(tiny_llama):
    reference = engine_chat(tiny_llama, SYSTEM)

    async def scenario():
        async with local_cluster(tiny_llama, local_prefill="auto") as (router, prefills, decodes):

            def slow_link():  # a tiny model's steps take a millisecond: make the decision plain
                router.placement.link_s_per_token = 0.01

            history, timings = await chat(router, SYSTEM, between=slow_link)
            assert history == reference
            first, follow_ups = timings[0], timings[1:]
            assert first["prefill_node"] == prefills[0].address and not first.get("local_prefill")
            for t, prompt_len in zip(follow_ups, (33, 41, 49)):
                # the decode node held the conversation (imported KV, then its own): only the suffix
                assert t["prefill_node"] == decodes[0].address and t["local_prefill"], t
                assert prompt_len - 8 <= t["cached_tokens"] < prompt_len, t
                assert "kv_transport" not in t
            assert router.metrics.sample("pdserve_prefills_total", where="remote") == 1
            assert router.metrics.sample("pdserve_prefills_total", where="local") == 3
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


@pytest.mark.parametrize("bound, local", [(1e-6, False), (10.0, True)])
def test_a_tpot_bound_measured_from_the_streams_places_follow_ups_with_the_same_tokens(
    tiny_llama, bound, local, monkeypatch
):
    """With a long request decoding on the decode node, follow-ups its cache holds prefill there
    under a bound its token gaps meet, and on the prefill node over one (fp32: the same tokens)."""
    reference = engine_chat(tiny_llama, SYSTEM)
    decided, decide = [], Placement.decide

    def recorded(self, *a, **k):
        decided.append((decide(self, *a, **k), k["decode_running"]))
        return decided[-1][0]

    monkeypatch.setattr(Placement, "decide", recorded)

    async def scenario():
        async with local_cluster(
            tiny_llama,
            decode_engine={"num_kv_blocks": 512},  # the long request's 1,004 tokens and the chat's beside
            local_prefill="auto",
            max_local_prefill_tpot=bound,
        ) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                streaming = asyncio.Event()

                async def background():
                    async for _ in client.stream([5, 6, 7, 8], max_tokens=1000, temperature=0, ignore_eos=True):
                        streaming.set()

                long = asyncio.create_task(background())
                await asyncio.wait_for(streaming.wait(), 120)

                def slow_link():  # a tiny model's steps take a millisecond: make the decision plain
                    router.placement.link_s_per_token = 0.01

                history, timings = await chat(router, SYSTEM, between=slow_link)
                assert not long.done(), "the long request ended before the follow-ups: nobody to protect"
                long.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await long
            assert history == reference
            assert [bool(t.get("local_prefill")) for t in timings[1:]] == [local] * 3
            follow_ups = decided[-3:]  # each with the long request (at least) decoding there, its gaps measured
            assert all(running >= 1 and 0 < d.decode_tpot_s < 1.0 for d, running in follow_ups), follow_ups
            assert all((d.decode_tpot_s > bound) != local for d, _ in follow_ups)
            assert router.metrics.sample("pdserve_decode_node_tpot_seconds", node=decodes[0].address) > 0
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_off_and_always(tiny_llama):
    reference = engine_chat(tiny_llama, SYSTEM, turns=2)

    async def scenario():
        for mode, local in (("off", False), ("always", True)):
            async with local_cluster(tiny_llama, local_prefill=mode) as (router, prefills, decodes):
                history, timings = await chat(router, SYSTEM, turns=2)
                assert history == reference
                assert [bool(t.get("local_prefill")) for t in timings] == [local, local]
                assert used_prefill_nodes(timings) == ({decodes[0].address} if local else {prefills[0].address})
                await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


@pytest.mark.parametrize("frees_first", ["prefill node", "decode node"])
def test_a_held_request_goes_where_a_prefill_ends_first_with_the_same_tokens(tiny_llama, frees_first, monkeypatch):
    """Both sides busy with this router's prefills (held open here through the router's own
    accounting), the prefill node's queue long: the request's place is its decode node, behind the
    local prefill there, so the router holds it, as long as both stay busy. When one of them ends
    it is placed again (woken by that end: the periodic look is an hour here): on the prefill node
    if that freed first, else locally. Its tokens are the engine alone's (fp32) either way."""
    want = engine_alone(tiny_llama, [SYSTEM], max_tokens=6, temperature=0, ignore_eos=True)[0]
    monkeypatch.setattr(router.server, "HOLD_RECHECK_S", 3600.0)

    async def scenario():
        async with local_cluster(tiny_llama, local_prefill="auto") as (router_, prefills, decodes):
            for n in (100, 500, 1000):  # a prefill pool measured: 30 ms + 1 ms a token
                router_.placement.measured_remote(n, 0.03 + 0.001 * n, 1e-3, n, 0.005, alone=True)
            remote, local = router_.prefill_pool.endpoints[0], router_.decode_pool.endpoints[0]
            busy_on = {"prefill node": contextlib.ExitStack(), "decode node": contextlib.ExitStack()}
            busy_on["prefill node"].enter_context(router_._prefilling(remote, 10**5))
            busy_on["decode node"].enter_context(router_._prefilling(local, 500))
            try:
                async with AsyncClient(router_.address) as client:
                    request = asyncio.ensure_future(
                        client.generate(SYSTEM, max_tokens=6, temperature=0, ignore_eos=True)
                    )
                    done, _ = await asyncio.wait([request], timeout=2.0)
                    assert not done  # held
                    # one held with a deadline (the HTTP API's x-request-timeout) ends at it, named
                    with pytest.raises(RequestError, match="deadline passed while waiting for a prefill") as err:
                        await anext(router_.serve(build_request(SYSTEM, max_tokens=6), deadline=time.time() + 1.0))
                    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                    busy_on[frees_first].close()
                    result = await asyncio.wait_for(request, 600)  # (a guard against a hang, not a timing)
            finally:
                for stack in busy_on.values():
                    stack.close()
            assert result.token_ids == want
            assert bool(result.timings.get("local_prefill")) == (frees_first == "decode node"), result.timings
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def used_prefill_nodes(timings) -> set[str]:
    return {t["prefill_node"] for t in timings}


def test_no_healthy_prefill_node_prefills_on_the_decode_node(tiny_llama):
    async def scenario():
        async with local_cluster(tiny_llama, local_prefill="auto") as (router, prefills, decodes):
            await prefills[0].stop(0)
            await router.prefill_pool.check_all()
            await router.prefill_pool.check_all()
            async with AsyncClient(router.address) as client:
                result = await client.generate(SYSTEM, max_tokens=4, temperature=0)
            assert result.timings["local_prefill"] and len(result.token_ids) == 4

    asyncio.run(scenario())


def test_a_local_prefill_request_with_a_kv_source_or_a_bad_prompt_is_refused(tiny_llama):
    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            async with grpc.aio.insecure_channel(decodes[0].address) as channel:
                stub = nodes_pb2_grpc.DecodeNodeStub(channel)
                base = dict(
                    request_id="x",
                    prompt_token_ids=SYSTEM,
                    prefill_locally=True,
                    sampling=nodes_pb2.DecodeRequest().sampling,
                )
                for extra, words in (
                    (dict(kv=nodes_pb2.KVSource(lease_id="l")), "carries no kv source"),
                    (dict(prompt_token_ids=[10**6]), "must be integers in"),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in stub.Decode(nodes_pb2.DecodeRequest(**{**base, **extra})):
                            pass
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
            await wait_for_no_blocks(decodes)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "mode, decode_reads, same_host, streams",
    [
        ("auto", "auto", True, False),  # one host: shared memory moves the whole KV at once
        ("auto", "auto", False, True),  # across hosts: the TCP plane streams it layer by layer
        ("auto", "tcp", True, True),  # a decode node told --kv-transport tcp
        ("auto", "grpc", False, False),
        ("on", "auto", True, True),  # on: wherever some transport between the two can
        ("on", "grpc", True, False),
        ("off", "tcp", False, False),
    ],
)
def test_layerwise_streaming_follows_what_the_nodes_can_do(mode, decode_reads, same_host, streams):
    """The router decides from the nodes' reported transports (NodeLoad.kv_transports)."""
    from types import SimpleNamespace

    from kvtransfer import transports
    from kvtransfer.base import Capabilities, ReaderContext, options_for
    from pdserve_api import common_pb2
    from router.config import RouterConfig
    from router.pool import Endpoint
    from router.server import Router

    senders = [
        Capabilities("shm", partial=True, same_host=True),
        Capabilities("tcp", layerwise=True, partial=True),
        Capabilities("grpc"),
    ]  # a prefill node on the CPU with shared memory
    readers = [
        t.reader(ReaderContext(options=options_for(t.reader_options, ()))).capabilities()
        for t in transports.named(decode_reads)
    ]
    prefill = Endpoint(
        "p", None, None, load=common_pb2.NodeLoad(host_id="a", kv_transports=[c.to_proto() for c in senders])
    )
    decode = Endpoint(
        "d",
        None,
        None,
        load=common_pb2.NodeLoad(host_id="a" if same_host else "b", kv_transports=[c.to_proto() for c in readers]),
    )
    router = SimpleNamespace(config=RouterConfig(kv_layerwise=mode), kv_read=Router.kv_read)
    assert Router.layerwise(router, prefill, decode) is streams
