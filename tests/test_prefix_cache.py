"""Automatic prefix caching: the block manager's naming, sharing and LRU eviction, and the engine
giving the same tokens with and without it while computing only what is not cached."""

from __future__ import annotations

import pytest
from conftest import assert_no_blocks_used, make_engine, run_to_completion

from engine import SamplingParams
from engine.block_manager import BlockManager, block_hashes
from engine.sampling_params import SamplingParams as Params
from engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SYSTEM = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39]  # 23 tokens


def seq(rid, tokens) -> Sequence:
    return Sequence(rid, list(tokens), Params(max_tokens=4))


def computed(bm: BlockManager, q: Sequence, num_tokens: int | None = None) -> None:
    """As the scheduler does: blocks for the prompt, KV computed, full blocks named."""
    bm.allocate(q, q.num_tokens)
    q.num_computed_tokens = q.num_tokens if num_tokens is None else num_tokens
    bm.cache_computed_blocks(q)


def greedy_tokens(model, prompts: dict, **engine_kwargs):
    """12 greedy tokens per prompt, all in one engine (batched, preempted where the pool is small);
    checks no block is left used. Returns (request id -> tokens, the engine)."""
    engine = make_engine(model, **engine_kwargs)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    done = run_to_completion(engine)
    assert_no_blocks_used(engine)
    return {rid: out.token_ids for rid, out in done.items()}, engine


def test_a_shared_prefix_is_taken_from_the_cache_and_the_last_token_is_always_computed():
    bm = BlockManager(16, 4)
    a = seq("a", range(1, 11))  # 10 tokens: 2 full blocks named
    computed(bm, a)
    assert bm.num_cached_blocks == 2
    b = seq("b", list(range(1, 9)) + [50, 51, 52])  # the same first 8 tokens
    assert bm.acquire_prefix(b) == 8 and b.block_table == a.block_table[:2]
    assert [bm.ref_counts[x] for x in b.block_table] == [2, 2]
    c = seq("c", range(1, 9))  # exactly two blocks: the last token is computed again
    assert bm.acquire_prefix(c) == 4
    d = seq("d", [1, 2, 3, 5, 5, 6, 7, 8])  # differs in block 0: nothing, whatever follows
    assert bm.acquire_prefix(d) == 0 and d.block_table == []
    assert block_hashes([1, 2, 3, 4, 5], 4) == [a.block_hashes[0]]


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first_and_empty_ones_go_first():
    bm = BlockManager(4, 2)
    a, b = seq("a", [1, 2, 3]), seq("b", [7, 8, 9])  # one full block each
    computed(bm, a)
    computed(bm, b)
    block_a, block_b = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert bm.allocate_blocks(2) and bm.num_cached_blocks == 2  # the two unnamed blocks first
    assert bm.allocate_blocks(1) == [block_a] and bm.num_evicted_blocks == 1  # a was freed first
    again = seq("b2", [7, 8, 9, 10])
    assert bm.acquire_prefix(again) == 2 and again.block_table == [block_b]  # a hit takes it off the LRU
    assert bm.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate_blocks(1)


def test_off_means_nothing_is_named_or_found():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = seq("a", [1, 2, 3, 4, 5])
    computed(bm, a)
    assert bm.num_cached_blocks == 0 and bm.acquire_prefix(seq("b", [1, 2, 3, 4, 5])) == 0


def conversation(engine, turns: int = 4) -> tuple[list[list[int]], list[int]]:
    """A chat: each turn's prompt is the system prompt, every earlier prompt and answer, and a new
    question; returns the answers and each turn's cached prompt tokens."""
    history, answers, cached = list(SYSTEM), [], []
    for turn in range(turns):
        history += [100 + turn, 101 + turn, 7]
        engine.add_request(f"t{turn}", history, GREEDY)
        out = run_to_completion(engine)[f"t{turn}"]
        answers.append(out.token_ids)
        cached.append(out.num_cached_tokens)
        history += out.token_ids
    return answers, cached


def test_a_conversation_gets_the_same_tokens_and_reuses_its_history(tiny_llama):
    off = make_engine(tiny_llama, enable_prefix_caching=False)
    on = make_engine(tiny_llama)
    answers_off, cached_off = conversation(off)
    answers_on, cached_on = conversation(on)
    assert answers_on == answers_off
    assert cached_off == [0, 0, 0, 0]
    # Turn k+1's prompt holds turn k's prompt and answer: all full blocks of it but the last token's.
    lengths = [len(SYSTEM) + 3 * (k + 1) + 8 * k for k in range(4)]
    assert cached_on == [0] + [(lengths[k] + 8 - 1) // 4 * 4 for k in range(3)]
    stats = on.prefix_cache_stats()
    assert stats["hit_tokens"] == sum(cached_on) and stats["query_tokens"] == sum(lengths)
    assert_no_blocks_used(on)


def test_shared_system_prompt_across_a_batch_with_preemption_gives_the_same_tokens(tiny_llama):
    """Many requests on one system prompt in a pool too small for them all: blocks are shared,
    preempted sequences recompute from the cache, evictions happen; tokens are as without caching."""
    prompts = {f"r{i}": SYSTEM + [200 + i, 201 + i, 202 + i] * (1 + i % 3) for i in range(8)}
    reference, _ = greedy_tokens(tiny_llama, prompts, num_kv_blocks=24, enable_prefix_caching=False)
    tokens, engine = greedy_tokens(tiny_llama, prompts, num_kv_blocks=24)
    assert tokens == reference
    assert engine.block_manager.num_hit_tokens > 0
    assert engine.scheduler.num_preemptions > 0 or engine.block_manager.num_evicted_blocks > 0


def test_prompts_on_one_system_prompt_sent_together_compute_it_once(tiny_llama):
    """Four requests on one uncached system prompt, added at once: the first computes it, the
    others wait a step and take its blocks; greedy tokens as without caching (fp32)."""
    prompts = {f"r{i}": SYSTEM + [200 + i, 201 + i] for i in range(4)}
    reference, _ = greedy_tokens(tiny_llama, prompts, enable_prefix_caching=False)
    engine = make_engine(tiny_llama)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    done = run_to_completion(engine)
    assert {rid: out.token_ids for rid, out in done.items()} == reference
    assert [done[rid].num_cached_tokens for rid in prompts] == [0, 20, 20, 20]  # SYSTEM's 5 full blocks
    assert_no_blocks_used(engine)


def test_cache_changes_give_routers_deltas_or_a_snapshot():
    bm = BlockManager(4, 2)
    assert bm.cache_changes(0) == {"cache_version": 0}  # nothing named yet
    a = seq("a", [1, 2, 3, 4, 5])
    computed(bm, a)
    names = a.block_hashes[:2]
    assert bm.cache_changes(0) == {"cache_version": 2, "cached_added": names, "cache_snapshot": True}
    assert bm.cache_changes(1) == {"cache_version": 2, "cached_added": names[1:], "cached_removed": []}
    assert bm.cache_changes(2) == {"cache_version": 2}
    bm.free(a)
    bm.allocate_blocks(4)  # two empty blocks, then both named ones are evicted
    assert bm.cache_changes(2) == {"cache_version": 4, "cached_added": [], "cached_removed": names[::-1]}
    assert bm.cache_changes(99)["cache_snapshot"]  # another engine's version (a restarted node)
    bm.cache_events.clear()  # events dropped: a router that far behind gets the whole set
    assert bm.cache_changes(1) == {"cache_version": 4, "cached_added": [], "cache_snapshot": True}


def test_the_router_prefers_the_node_holding_the_prefix_until_load_outweighs_it():
    from pdserve_api import common_pb2
    from router.pool import Endpoint, EndpointPool

    pool = EndpointPool("prefill", [], affinity_tokens=16)
    prompt = list(range(1, 42))  # 40 tokens before the last: 10 blocks of 4
    cold, warm = (Endpoint(address, None, None, healthy=True) for address in ("cold:1", "warm:1"))
    pool.endpoints = [cold, warm]
    cold.apply_load(common_pb2.NodeLoad(block_size=4, cache_version=1, cached_added=[7], cache_snapshot=True))
    warm.apply_load(
        common_pb2.NodeLoad(
            block_size=4, cache_version=3, cached_added=block_hashes(prompt, 4)[:8], cache_snapshot=True
        )
    )
    assert warm.cached_tokens({4: block_hashes(prompt[:-1], 4)}) == 32
    assert pool.pick(prompt=prompt) is warm
    warm.outstanding = 3  # 32 cached tokens are worth 2 requests in flight (16 tokens each): 3 outweigh them
    cold.outstanding = 0
    assert pool.pick(prompt=prompt) is cold
    warm.outstanding = 1
    assert pool.pick(prompt=prompt) is warm
    warm.apply_load(common_pb2.NodeLoad(block_size=4, cache_version=4, cached_removed=block_hashes(prompt, 4)[:1]))
    assert warm.cached_tokens({4: block_hashes(prompt[:-1], 4)}) == 0 and pool.pick(prompt=prompt) is cold
    assert EndpointPool("prefill", [], affinity_tokens=0).pick  # 0: caches ignored (tested in the cluster)


def test_a_conversation_sticks_to_the_prefill_node_holding_its_history(tiny_llama):
    import asyncio

    from cluster import local_cluster, wait_for_no_blocks

    from router.client import AsyncClient

    async def chat(router, first: list[int]) -> list[dict]:
        history, timings = list(first), []
        async with AsyncClient(router.address) as client:
            for turn in range(4):
                history += [100 + turn, 7]
                result = await client.generate(history, max_tokens=6, temperature=0, ignore_eos=True)
                timings.append(result.timings)
                history += result.token_ids
        return timings

    async def scenario():
        async with local_cluster(tiny_llama, num_prefill=2) as (router, prefills, decodes):
            a, b = await asyncio.gather(chat(router, SYSTEM), chat(router, SYSTEM[::-1]))
            for timings in (a, b):
                assert len({t["prefill_node"] for t in timings}) == 1, timings
                assert all(t.get("cached_tokens", 0) >= 20 for t in timings[1:]), timings
            await wait_for_no_blocks(prefills + decodes)
        async with local_cluster(tiny_llama, num_prefill=2, cache_affinity_tokens=0) as (router, prefills, decodes):
            timings = await chat(router, SYSTEM)  # least-loaded, then round robin: it alternates
            assert len({t["prefill_node"] for t in timings}) == 2

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_a_decode_node_reads_only_the_blocks_its_cache_lacks(tiny_llama, transport):
    """Turn k+1 on the same decode node: its cache holds turn k's prompt and answer; shm (checked
    by generation counters) and tcp (digest per layer) leave those blocks out, grpc reads all."""
    import asyncio

    from cluster import local_cluster, wait_for_no_blocks
    from test_placement import chat, engine_chat

    reference = engine_chat(tiny_llama, SYSTEM, turns=3)

    async def scenario():
        async with local_cluster(tiny_llama, kv_transport=transport) as (router, prefills, decodes):
            history, timings = await chat(router, SYSTEM, turns=3)
            assert history == reference
            layout = decodes[0].layout
            for t, prompt_len in zip(timings, (25, 33, 41)):
                skipped = t.get("decode_cached_tokens", 0)
                assert int(t["kv_bytes"]) == layout.num_bytes(prompt_len - skipped), t
                if transport == "grpc" or prompt_len == 25:
                    assert skipped == 0, t
                else:  # all full blocks of the last turn's prompt and answer (tokens 0..prompt_len - 4)
                    assert skipped == (prompt_len - 3) // 4 * 4, t
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_a_name_collision_is_a_miss_never_another_prefixs_blocks(monkeypatch):
    """Names are 64-bit hashes: two prefixes can share one (by chance, or crafted as in
    CVE-2025-25183). Here every block of the same token sum gets one name, so [1,2,3,4] and
    [4,3,2,1] collide: the second must compute its own KV, not take the first's."""
    import engine.block_manager as block_manager

    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: parent * 31 + sum(tokens))
    bm = BlockManager(16, 4)
    a = seq("a", [1, 2, 3, 4, 9, 9, 9, 9, 5])
    computed(bm, a)
    assert bm.num_cached_blocks == 2
    b = seq("b", [4, 3, 2, 1, 9, 9, 9, 9, 5])  # the same names, other tokens in block 0
    assert bm.acquire_prefix(b) == 0 and b.block_table == [] and bm.num_collisions == 1
    computed(bm, b)  # its own blocks: block 0's name is taken, so neither is named after b's tokens
    assert bm.num_cached_blocks == 2 and bm.num_collisions == 2
    c = seq("c", [4, 3, 2, 1, 9, 9, 9, 9, 6])
    assert bm.acquire_prefix(c) == 0
    d = seq("d", [1, 2, 3, 4, 9, 9, 9, 9, 7])  # a's prefix: found, and checked
    assert bm.acquire_prefix(d) == 8 and d.block_table == a.block_table[:2]


def test_a_cache_salt_shares_blocks_only_among_requests_with_that_salt(monkeypatch):
    """cache_salt (vLLM's): tenants apart. The same prompt under another salt finds nothing, even
    when the names collide (here every salt's root is 0): the salt is in the checked key too. The
    router names the prompt the same way the node does."""
    import engine.block_manager as block_manager

    bm = BlockManager(32, 4)
    tokens = list(range(1, 11))
    a = Sequence("a", tokens, Params(max_tokens=4, cache_salt="tenant-a"))
    computed(bm, a)
    assert a.block_hashes == block_hashes(tokens, 4, "tenant-a")[:2] != block_hashes(tokens, 4)[:2]
    for salt, hit in (("tenant-a", 8), ("tenant-b", 0), ("", 0)):
        q = Sequence("q", tokens, Params(max_tokens=4, cache_salt=salt))
        assert bm.acquire_prefix(q) == hit, salt
        bm.free(q)
    monkeypatch.setattr(block_manager, "salt_root", lambda salt: 0)  # every salt names alike
    q = Sequence("q", tokens, Params(max_tokens=4, cache_salt="tenant-b"))
    q.block_hashes = block_hashes(tokens, 4)  # as if its names were a's
    bm.cached[q.block_hashes[0]] = a.block_table[0]
    assert bm.acquire_prefix(q) == 0 and bm.num_collisions == 1
    with pytest.raises(ValueError, match="cache_salt"):
        Params(cache_salt="x" * 1025)


def test_a_recycled_parent_block_is_never_a_prefix_for_its_old_children():
    """A key names its parent by (block, generation): when a parent block is evicted and reused
    while its child stays cached, the child (computed after the old contents) is not taken, even
    if the new contents carry the old name (as a colliding prefix would)."""
    bm = BlockManager(4, 2)
    a = seq("a", [1, 2, 3, 4, 5])
    computed(bm, a)  # blocks 0 (1, 2) and 1 (3, 4) named, 2 holds the tail
    parent, child = a.block_table[:2]
    bm.decref([a.block_table[2], parent, child])  # the parent freed before its child: evicted first
    a.block_table = []
    y = seq("y", [8, 8, 8])
    bm.allocate(y, 3)  # the two empty blocks
    x = seq("x", [1, 2])
    computed(bm, x)  # evicts the parent block and names it (1, 2) again
    assert x.block_table == [parent] and bm.block_hash[parent] is not None and bm.block_hash[child] is not None
    again = seq("again", [1, 2, 3, 4, 5])
    assert bm.acquire_prefix(again) == 2 and again.block_table == [parent]  # not the child
    assert bm.num_collisions == 1


def test_colliding_names_in_an_engine_give_the_tokens_of_no_cache(tiny_llama, monkeypatch):
    """Shared prefixes, preemption and eviction with a hash that collides all the time: every hit
    is checked, so the tokens are those without caching (fp32)."""
    import engine.block_manager as block_manager

    prompts = {f"r{i}": SYSTEM[: 4 + 3 * (i % 4)] + [200 + i, 201 + i, 202 + i] * (1 + i % 3) for i in range(10)}
    prompts |= {f"rev{i}": list(reversed(p)) for i, p in enumerate(list(prompts.values())[:4])}

    reference, _ = greedy_tokens(tiny_llama, prompts, num_kv_blocks=28, enable_prefix_caching=False)
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: (parent + sum(tokens)) % 5)
    tokens, engine = greedy_tokens(tiny_llama, prompts, num_kv_blocks=28)
    assert tokens == reference
    assert engine.block_manager.num_collisions > 0 and engine.block_manager.num_hit_tokens > 0
