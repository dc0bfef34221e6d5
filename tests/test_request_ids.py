"""Request ids that cannot collide (docs/reliability.md, security): the router and a colocated
node assign their own ids and keep the client's only as a label, and an engine refuses a second
stream under a live id before it registers it, so the first request is neither orphaned nor
aborted."""

from __future__ import annotations

import asyncio

import pytest
from cluster import local_cluster, wait_for_no_blocks
from conftest import make_engine

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from router.client import AsyncClient

HANG_S = 300  # a guard against a hang, far above a slow machine's time


def test_a_second_stream_under_a_live_id_is_refused_and_the_first_goes_on(tiny_llama):
    engine = make_engine(tiny_llama)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def scenario():
        first = aengine.stream("same", lambda: engine.add_request("same", [1, 2, 3], params))
        tokens = list((await anext(first)).new_token_ids)
        with pytest.raises(ValueError, match="request_id 'same' is already running"):
            async for _ in aengine.stream("same", lambda: engine.add_request("same", [4, 5], params)):
                pass
        async for out in first:
            tokens += out.new_token_ids
        return tokens

    aengine = AsyncEngine(engine)
    try:
        tokens = asyncio.run(asyncio.wait_for(scenario(), HANG_S))
    finally:
        aengine.stop()
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
