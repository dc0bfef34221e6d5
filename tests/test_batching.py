"""Continuous batching, preemption, static batching, chunked prefill and KV export/import all give
the tokens a request gets when it runs alone."""

from __future__ import annotations

import pytest
from conftest import assert_no_blocks_used, make_engine, run_to_completion

from engine import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = {
    "a": [5, 17, 33, 8, 90, 41, 7, 99, 100, 3, 4],
    "b": [200, 3],
    "c": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27],
    "d": [64, 65, 66],
}


def alone(model, request_id: str, params=GREEDY) -> list[int]:
    engine = make_engine(model)
    engine.add_request(request_id, PROMPTS[request_id], params)
    return run_to_completion(engine)[request_id].token_ids


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return {rid: alone(tiny_llama, rid) for rid in PROMPTS}


def test_request_joining_mid_decode_gets_the_same_tokens(tiny_llama, reference):
    engine = make_engine(tiny_llama)
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.add_request("b", PROMPTS["b"], GREEDY)
    done = {}
    for step in range(200):
        if step == 5:  # a and b are mid-decode
            engine.add_request("c", PROMPTS["c"], GREEDY)
        if step == 9:
            engine.add_request("d", PROMPTS["d"], GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if len(done) == 4:
            break
    assert done == reference
    assert_no_blocks_used(engine)


def test_finished_sequences_leave_at_once(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("short", PROMPTS["a"], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.add_request("long", PROMPTS["b"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    engine.step()  # prefill of both: first token each
    engine.step()  # short's second token: it finishes
    assert [s.request_id for s in engine.scheduler.running] == ["long"]


def test_preemption_by_recompute_gives_the_same_tokens(tiny_llama, reference):
    # 12 blocks of 4 tokens cannot hold four sequences of up to 37 tokens: some are preempted.
    engine = make_engine(tiny_llama, num_kv_blocks=12, block_size=4)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    outs = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    assert {rid: o.token_ids for rid, o in outs.items()} == reference
    assert_no_blocks_used(engine)


def test_static_batching_gives_the_same_tokens_and_admits_only_between_batches(tiny_llama, reference):
    engine = make_engine(tiny_llama, scheduling="static", max_num_seqs=2)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    running_sets = []
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
        running_sets.append(tuple(s.request_id for s in engine.scheduler.running))
    assert outs == reference
    # The second batch (c, d) starts only once a and b are both done.
    assert ("a", "b") in running_sets and ("c", "d") in running_sets
    assert not any(set(r) & {"a", "b"} and set(r) & {"c", "d"} for r in running_sets)


def test_chunked_prefill_gives_the_same_tokens(tiny_llama, reference):
    engine = make_engine(tiny_llama, max_num_batched_tokens=5)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    outs = run_to_completion(engine)
    assert {rid: o.token_ids for rid, o in outs.items()} == reference
    assert_no_blocks_used(engine)


def test_without_chunked_prefill_a_long_prompt_waits_for_budget(tiny_llama, reference):
    engine = make_engine(tiny_llama, max_num_batched_tokens=17, enable_chunked_prefill=False)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    outs = run_to_completion(engine)
    assert {rid: o.token_ids for rid, o in outs.items()} == reference


def test_max_num_seqs_bounds_the_running_batch(tiny_llama, reference):
    engine = make_engine(tiny_llama, max_num_seqs=2)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
        assert len(engine.scheduler.running) <= 2
    assert outs == reference


def test_kv_export_import_continues_exactly(tiny_llama, reference):
    """Prefill on one engine, move the KV, decode on another: same tokens as one engine."""
    prefill = make_engine(tiny_llama, block_size=4)
    decode = make_engine(tiny_llama, block_size=8, num_kv_blocks=64)  # a different block layout
    for rid, prompt in PROMPTS.items():
        prefill.add_prefill(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    firsts = run_to_completion(prefill)
    assert prefill.block_manager.num_used_blocks > 0  # the leases hold the prompts' KV
    for rid, prompt in PROMPTS.items():
        kv = prefill.export_kv(rid)  # [layers, 2, tokens, kv_heads, head_dim]
        assert kv.shape[2] == len(prompt)
        prefill.release_kv(rid)
        blocks = decode.reserve_kv(len(prompt))
        decode.kv_cache.import_kv(blocks, kv)
        decode.add_prefilled_request(rid, prompt, firsts[rid].token_ids, GREEDY, blocks)
    outs = run_to_completion(decode)
    assert {rid: o.token_ids for rid, o in outs.items()} == reference
    assert_no_blocks_used(prefill)
    assert_no_blocks_used(decode)


def test_abort_frees_blocks_and_leaves_the_others_alone(tiny_llama, reference):
    engine = make_engine(tiny_llama)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    engine.step()
    engine.step()
    assert engine.abort_request("c")
    assert not engine.abort_request("c")
    outs = run_to_completion(engine)
    assert set(outs) == {"a", "b", "d"}
    assert {rid: outs[rid].token_ids for rid in outs} == {rid: reference[rid] for rid in outs}
    assert_no_blocks_used(engine)


def test_aborting_a_leased_request_before_it_finishes_frees_its_blocks(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_prefill("x", PROMPTS["c"], SamplingParams(max_tokens=1))
    engine.abort_request("x")
    run_to_completion(engine)
    assert engine.kv_leases == {}
    assert_no_blocks_used(engine)


def test_a_preempted_sequence_never_waits_forever_behind_imported_kv(tiny_llama):
    """A decode node's deadlock (found by the random combination test): a sequence preempted
    while nothing else runs heads the queue and needs more blocks than are free, while requests
    behind it hold theirs (imported KV). FIFO admission froze the node, its engine spinning; now
    the blocks of the sequences behind are taken back (they are recomputed, as after a preemption)."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    head, behind = list(range(20, 40)), list(range(50, 69))  # 20 tokens (5 blocks of 4), 19 tokens
    want = {}
    for rid, prompt in (("head", head), ("behind", behind)):
        alone_engine = make_engine(tiny_llama)
        alone_engine.add_request(rid, prompt, params)
        want[rid] = run_to_completion(alone_engine)[rid].token_ids
    prefill = make_engine(tiny_llama)
    prefill.add_prefill("behind", behind, SamplingParams(max_tokens=1, temperature=0))
    first = run_to_completion(prefill)["behind"].token_ids
    engine = make_engine(tiny_llama, num_kv_blocks=10)
    engine.add_request("head", head, params)
    engine.step()  # head's prompt: 5 blocks
    blocks = engine.reserve_kv(len(behind))  # the other 5: a transfer's destination
    engine.kv_cache.import_kv(blocks, prefill.export_kv("behind"))
    engine.step()  # head needs a 6th block: preempted (nothing else runs), back at the queue's head
    assert engine.scheduler.num_preemptions == 1 and engine.scheduler.waiting[0].request_id == "head"
    engine.add_prefilled_request("behind", behind, first, params, blocks)  # waits behind it, holding 5
    done = run_to_completion(engine, max_steps=500)
    assert {rid: o.token_ids for rid, o in done.items()} == want
    assert_no_blocks_used(engine)


def test_a_prefill_hands_off_or_ends_by_the_requests_own_rule(tiny_llama, reference):
    """LLMEngine.add_prefill, the prefill side's request kind: the request's next token, as
    add_request samples it, and its KV under a kv_lease, with finish_reason None (it goes on at a
    decode node); or, where the request's own rule ends it at that token, that reason (the lease
    is held all the same until released: a layer-wise reader may still be reading it)."""
    from dataclasses import replace

    engine = make_engine(tiny_llama)
    prompt = engine.tokenize(PROMPTS["a"])
    first = reference["a"][0]
    cases = {
        "goes-on": (GREEDY, None),
        "max-tokens": (replace(GREEDY, max_tokens=1), "length"),
        "stop-token": (replace(GREEDY, stop_token_ids=(first,)), "stop"),
    }
    for rid, (params, _) in cases.items():
        engine.add_prefill(rid, prompt, params)
    outs = run_to_completion(engine)
    for rid, (_, reason) in cases.items():
        assert outs[rid].finished and outs[rid].finish_reason == reason, rid
        assert outs[rid].token_ids == [first]
        lease = engine.kv_lease(rid)
        assert lease.num_tokens == len(prompt) and engine.export_kv(rid).shape[2] == len(prompt)
        engine.release_kv(rid)
    assert_no_blocks_used(engine)
