"""Request ids that cannot collide (docs/reliability.md, security): the router and a colocated
node assign their own ids and keep the client's only as a label, and an engine refuses a second
stream under a live id before it registers it, so the first request is neither orphaned nor
aborted."""

from __future__ import annotations

import asyncio

import pytest
from cluster import local_cluster, wait_for_no_blocks
from conftest import make_engine

from engine import LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine
from router.client import AsyncClient

HANG_S = 300  # a guard against a hang, far above a slow machine's time


PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def live_and_second(model, second) -> tuple[list[int], LLMEngine]:
    """A live stream under "same" on an AsyncEngine, second(aengine, add) meanwhile (add: what a
    second "same" request would add); returns the live stream's tokens, all of them."""
    engine = make_engine(model)
    aengine = AsyncEngine(engine)

    async def scenario():
        first = aengine.stream("same", lambda: engine.add_request("same", [1, 2, 3], PARAMS))
        tokens = list((await anext(first)).new_token_ids)
        await second(aengine, lambda: engine.add_request("same", [4, 5], PARAMS))
        async for out in first:
            tokens += out.new_token_ids
        return tokens

    try:
        return asyncio.run(asyncio.wait_for(scenario(), HANG_S)), engine
    finally:
        aengine.stop()


def test_a_second_stream_under_a_live_id_is_refused_and_the_first_goes_on(tiny_llama):
    async def second(aengine, add):
        with pytest.raises(ValueError, match="request_id 'same' is already running"):
            async for _ in aengine.stream("same", add):
                pass

    tokens, engine = live_and_second(tiny_llama, second)
    assert len(tokens) == 24
    assert not engine.has_unfinished()


@pytest.mark.parametrize("local_prefill", ["off", "auto"])
def test_two_clients_with_the_same_request_id_each_get_their_own_answer(tiny_llama, local_prefill):
    """Both at once through the router, remote or local prefill: each stream carries its own
    prompt's tokens, labelled with the id its client chose, and no node holds a block after."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    params = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}

    async def scenario():
        async with local_cluster(tiny_llama, local_prefill=local_prefill) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                alone = [await client.generate(p, **params) for p in prompts]
                both = await asyncio.gather(*(client.generate(p, request_id="same", **params) for p in prompts))
            await wait_for_no_blocks(prefills + decodes)
            return alone, both

    alone, both = asyncio.run(asyncio.wait_for(scenario(), HANG_S))
    assert [c.token_ids for c in both] == [c.token_ids for c in alone]
    assert {c.request_id for c in both} == {"same"}


def test_a_cancelled_second_stream_under_a_live_id_leaves_the_first_alone(tiny_llama):
    """Cancelled while its add waits its turn: the abort queued behind it is for its own request
    only, and its add was refused, so the live request goes on to the end."""

    async def second(aengine, add):
        call = asyncio.ensure_future(anext(aengine.stream("same", add)))
        await asyncio.sleep(0)  # its add is queued
        call.cancel()
        with pytest.raises((asyncio.CancelledError, ValueError)):
            await call

    tokens, _ = live_and_second(tiny_llama, second)
    assert len(tokens) == 24


def test_a_decode_call_under_a_live_id_is_refused_and_its_blocks_go_back(tiny_llama):
    """On a decode node's internal port: the second Decode's KV was read into blocks reserved for
    it; refused as the id is live, those blocks return, and the first request ends whole."""
    import grpc

    from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            async with (
                grpc.aio.insecure_channel(prefills[0].address) as p,
                grpc.aio.insecure_channel(decodes[0].address) as d,
            ):
                prompt, sampling = [1, 2, 3, 4, 5], common_pb2.SamplingParams(max_tokens=30, ignore_eos=True)
                prefill = nodes_pb2_grpc.PrefillNodeStub(p)
                ask = nodes_pb2.PrefillRequest(prompt_token_ids=prompt, sampling=sampling)
                replies = [await prefill.Prefill(ask) for _ in range(2)]
                decode = nodes_pb2_grpc.DecodeNodeStub(d)

                def call(reply):
                    ask = nodes_pb2.DecodeRequest(
                        request_id="dup",
                        prompt_token_ids=prompt,
                        output_token_ids=[reply.first_token_id],
                        sampling=sampling,
                        kv=reply.kv,
                    )
                    return decode.Decode(ask)

                first = call(replies[0])
                tokens = [replies[0].first_token_id, *(await first.read()).token_ids]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call(replies[1]):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "request_id 'dup' is already running" in err.value.details()
                while (part := await first.read()) is not grpc.aio.EOF:
                    tokens += part.token_ids
                assert len(tokens) == 30
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(asyncio.wait_for(scenario(), HANG_S))
