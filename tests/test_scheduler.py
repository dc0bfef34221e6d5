"""The scheduler and block manager driven with faked runner outputs: no model, milliseconds."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus


def make(num_blocks=16, block_size=4, max_model_len=1000, **cfg) -> Scheduler:
    return Scheduler(
        EngineConfig(block_size=block_size, **cfg),
        BlockManager(num_blocks, block_size),
        max_model_len,
        eos_token_ids=(0,),
    )


def seq(rid, n_prompt, max_tokens=5, first=1) -> Sequence:
    return Sequence(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def fake_step(s: Scheduler, token=7):
    batch = s.schedule()
    sampled = [
        [token] if q.num_computed_tokens + n == q.num_tokens else []
        for q, n in zip(batch.seqs, batch.num_scheduled_tokens)
    ]
    return batch, s.update(batch, sampled)


def test_block_manager_refcounts_and_free_list():
    bm = BlockManager(4, 2)
    a = seq("a", 3)
    assert bm.can_allocate(a, 3)
    bm.allocate(a, 3)
    assert a.block_table == [0, 1] and bm.num_free_blocks == 2
    bm.allocate(a, 4)  # still fits in two blocks
    assert bm.num_free_blocks == 2
    bm.incref(a.block_table)  # a kv_lease
    bm.free(a)
    assert bm.num_free_blocks == 2  # the lease still holds them
    bm.decref([0, 1])
    assert bm.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        bm.decref([0])
    assert not bm.can_allocate(seq("b", 9), 9)


def test_prefill_then_one_token_per_step():
    s = make()
    s.add(seq("a", 6))
    batch, _ = fake_step(s)
    assert batch.num_scheduled_tokens == [6]
    batch, _ = fake_step(s)
    assert batch.num_scheduled_tokens == [1]


def test_token_budget_chunks_a_long_prompt():
    s = make(max_num_batched_tokens=4)
    s.add(seq("a", 10))
    counts = [fake_step(s)[0].num_scheduled_tokens for _ in range(4)]
    assert counts == [[4], [4], [2], [1]]


def test_running_decodes_go_before_new_prefills():
    s = make(max_num_batched_tokens=8)
    s.add(seq("a", 3))
    fake_step(s)
    s.add(seq("b", 20))
    batch, _ = fake_step(s)
    assert [q.request_id for q in batch.seqs] == ["a", "b"]
    assert batch.num_scheduled_tokens == [1, 7]


def test_preemption_takes_the_newest_and_requeues_it_first():
    s = make(num_blocks=4, block_size=2)
    a = seq("a", 3, max_tokens=10)
    b = Sequence("b", [4, 5, 6], SamplingParams(max_tokens=10, ignore_eos=True))  # (a's prompt: b would wait for it)
    s.add(a)
    s.add(b)
    fake_step(s)  # both prefilled (positions 0-2): 2 blocks each, pool full
    fake_step(s)  # position 3 still fits
    batch, _ = fake_step(s)  # position 4 needs a third block each -> b, the newest, is preempted
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert s.waiting[0] is b and [q.request_id for q in batch.seqs] == ["a"]
    assert s.num_preemptions == 1


def test_prompts_beside_decodes_take_their_share_of_the_step_and_the_whole_budget_alone():
    s = make(max_num_batched_tokens=64, prefill_tokens_with_decodes=4)
    s.add(seq("a", 3, max_tokens=3))
    assert fake_step(s)[0].num_scheduled_tokens == [3]  # nothing decodes yet: the whole prompt
    s.add(seq("b", 12))
    s.add(seq("c", 12, first=100))  # (no prefix of b's)
    counts = [fake_step(s)[0].num_scheduled_tokens for _ in range(4)]
    # a decodes twice beside 4 of b's tokens, then finishes; b's rest and all of c go in one step
    assert counts == [[1, 4], [1, 4], [4, 12], [1, 1]]


def test_kv_computed_elsewhere_is_not_held_back_by_the_prompts_share():
    s = make(max_num_batched_tokens=64, prefill_tokens_with_decodes=4)
    s.add(seq("a", 3))
    fake_step(s)
    s.add(seq("b", 12))  # prompts: b takes the share, c waits for it
    s.add(seq("c", 12, first=100))
    # prompts' KV from a prefill node (add_prefilled_request): with its first token, and without
    # (n > 1: each sample draws its own; forked samples start the same way)
    for rid, first in (("d", [9]), ("e", [])):
        imported = Sequence(rid, [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True), output_token_ids=first)
        imported.num_computed_tokens = imported.num_tokens - 1
        s.block_manager.allocate(imported, imported.num_computed_tokens)
        s.add(imported)
    batch, _ = fake_step(s)
    assert [(q.request_id, n) for q, n in zip(batch.seqs, batch.num_scheduled_tokens)] == [
        ("a", 1),
        ("b", 4),
        ("d", 1),
        ("e", 1),
    ]
    assert [q.request_id for q in s.waiting] == ["c"]  # first in line still


def test_without_chunked_prefill_a_prompt_beside_decodes_goes_whole():
    s = make(max_num_batched_tokens=64, prefill_tokens_with_decodes=4, enable_chunked_prefill=False)
    s.add(seq("a", 3))
    fake_step(s)
    s.add(seq("b", 12))
    assert fake_step(s)[0].num_scheduled_tokens == [1, 12]


@pytest.mark.parametrize("beside", [0, 3])
@pytest.mark.parametrize("caching", [False, True])
def test_random_workload_never_leaks_blocks(caching, beside):
    """Prompts share prefixes (1, 2, 3, ...): with caching, blocks are shared, evicted and reused;
    beside decodes, prompts get the whole budget, or a share of 3 tokens."""
    rng = random.Random(0)
    s = make(
        num_blocks=24,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        enable_prefix_caching=caching,
        prefill_tokens_with_decodes=beside,
    )
    s.block_manager.enable_prefix_caching = caching
    bm, live = s.block_manager, []
    for step in range(400):
        if rng.random() < 0.3:
            q = seq(f"r{step}", rng.randint(1, 30), max_tokens=rng.randint(1, 20))
            s.add(q)
            live.append(q)
        if rng.random() < 0.05 and live:
            s.finish(rng.choice(live), FinishReason.ABORT)
        if s.has_unfinished():
            fake_step(s)
        holders = [b for q in live for b in q.block_table]
        assert len(set(holders)) == bm.num_used_blocks
        assert all(bm.ref_counts[b] == holders.count(b) for b in set(holders))
        assert all(bm.ref_counts[b] == 0 for b in list(bm.empty) + list(bm.evictable))
        assert all(bm.block_hash[b] == name for name, b in bm.cached.items())
    for _ in range(1000):  # (a prompt held back for ever would fail here, not hang)
        if not s.has_unfinished():
            break
        fake_step(s)
    assert bm.num_used_blocks == 0
    assert all(q.is_finished for q in live)
    assert (bm.num_hit_tokens > 0 and bm.num_evicted_blocks > 0) == caching


def shared(rid, n_prompt, suffix=(), max_tokens=5) -> Sequence:
    """A prompt of 1..n_prompt (the shared prefix), then its own suffix."""
    tokens = list(range(1, n_prompt + 1)) + list(suffix)
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_requests_on_one_prefix_arriving_together_compute_it_once_and_others_go_ahead():
    """b and c share a's first 3 blocks, none cached yet: they wait while a computes them, then
    take them from the cache; d, unrelated, is not held up behind them."""
    s = make(num_blocks=32, block_size=4)
    a, b, c = shared("a", 13), shared("b", 12, [50, 51]), shared("c", 12, [60])
    d = Sequence("d", [90, 91, 92, 93, 94], SamplingParams(max_tokens=5, ignore_eos=True))
    for q in (a, b, c, d):
        s.add(q)
    batch, _ = fake_step(s)
    assert [q.request_id for q in batch.seqs] == ["a", "d"] and batch.num_scheduled_tokens == [13, 5]
    assert list(s.waiting) == [b, c] and not b.block_table and not c.block_table  # no blocks held while waiting
    batch, _ = fake_step(s)
    assert [q.request_id for q in batch.seqs] == ["a", "d", "b", "c"]
    assert b.num_cached_tokens == 12 and c.num_cached_tokens == 12  # a's three full blocks
    assert batch.num_scheduled_tokens[2:] == [2, 1]
    assert b.block_table[:3] == a.block_table[:3] == c.block_table[:3]


def test_a_request_waits_for_a_chunked_prefill_of_its_prefix_and_takes_every_block_of_it():
    s = make(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    a, b = shared("a", 20), shared("b", 20, [70, 71])
    s.add(a)
    s.add(b)
    chunks = []
    while not b.num_computed_tokens:
        batch, _ = fake_step(s)
        chunks.append([(q.request_id, n) for q, n in zip(batch.seqs, batch.num_scheduled_tokens)])
    assert chunks == [[("a", 8)], [("a", 8)], [("a", 4)], [("a", 1), ("b", 2)]]  # b: once a's prompt is in
    assert b.num_cached_tokens == 20


def test_without_prefix_caching_nobody_waits_for_anyone():
    s = make(num_blocks=32, block_size=4, enable_prefix_caching=False)
    s.block_manager.enable_prefix_caching = False
    a, b = shared("a", 13), shared("b", 13, [5])
    s.add(a)
    s.add(b)
    batch, _ = fake_step(s)
    assert [q.request_id for q in batch.seqs] == ["a", "b"]


def test_a_short_shared_start_is_not_worth_a_step_s_wait():
    """b shares only a's first block (4 of its 20 tokens): it is computed beside a, not after it."""
    s = make(num_blocks=32, block_size=4)
    a = shared("a", 4, range(100, 116))
    b = shared("b", 4, range(200, 216))
    s.add(a)
    s.add(b)
    batch, _ = fake_step(s)
    assert [q.request_id for q in batch.seqs] == ["a", "b"] and s.num_prefix_waits == 0


def test_a_held_back_prompt_keeps_its_slot_and_computes_the_prefix_itself_if_its_owner_goes():
    s = make(num_blocks=32, block_size=4, max_num_seqs=2)
    a, b, d = shared("a", 13), shared("b", 12, [50]), Sequence("d", [90, 91, 92], SamplingParams(max_tokens=5))
    for q in (a, b, d):
        s.add(q)
    batch = s.schedule()  # a alone: b is held back, and d may not take b's slot
    assert [q.request_id for q in batch.seqs] == ["a"] and list(s.waiting) == [b, d]
    s.finish(a, FinishReason.ABORT)  # its prefill never completes
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["b", "d"] and b.num_computed_tokens == 0  # computed by b itself
    assert s.num_prefix_waits == 1


def test_static_batching_holds_nobody_back():
    """A prompt held back would wait out the whole batch there: both compute the prefix."""
    s = make(num_blocks=32, block_size=4, scheduling="static")
    a, b = shared("a", 13), shared("b", 12, [50])
    s.add(a)
    s.add(b)
    batch, _ = fake_step(s)
    assert [q.request_id for q in batch.seqs] == ["a", "b"]
