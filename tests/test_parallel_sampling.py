"""Parallel sampling (n, best_of): one prefill, the prompt's blocks shared, each sample its own seed."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from conftest import assert_no_blocks_used, make_engine, run_to_completion

from engine import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention stores"


def samples(engine, rid: str, prompt, params: SamplingParams) -> dict[int, object]:
    engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        done.update({o.index: o for o in engine.step() if o.finished and o.request_id == rid})
    return done


def count_scheduled(engine) -> list[int]:
    """Tokens each step computes (KV positions), recorded as the engine runs."""
    steps = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch: (steps.append(sum(batch.num_scheduled_tokens)), execute(batch))[1]
    return steps


def test_n_samples_share_one_prefill_and_equal_single_samples(tiny_llama):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=4, ignore_eos=True)
    engine = make_engine(tiny_llama)
    steps = count_scheduled(engine)
    outs = samples(engine, "r", PROMPT, params)
    num_prompt = len(engine.tokenize(PROMPT))
    # One prefill; then each forked sample computes only the last prompt token (plus decodes).
    assert steps[0] == num_prompt and steps[1] == 3 + 1 and sum(steps) == num_prompt + 3 + 4 * 11
    assert sorted(outs) == [0, 1, 2, 3] and len({tuple(o.token_ids) for o in outs.values()}) == 4
    for i, out in outs.items():  # sample i is the request run alone with sample i's parameters
        alone = samples(make_engine(tiny_llama), "x", PROMPT, params.for_sample(i))[0]
        assert out.token_ids == alone.token_ids and out.text == alone.text
    assert (
        outs[0].token_ids
        == samples(
            make_engine(tiny_llama),
            "y",
            PROMPT,
            SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True),
        )[0].token_ids
    )
    assert_no_blocks_used(engine)


def test_forked_samples_share_full_blocks_and_copy_the_last(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=8, temperature=1.0, n=3, ignore_eos=True))
    engine.step()  # the prefill; the fork
    engine.step()  # the samples' last prompt token, beside sample 0's first decode
    seqs = {s.index: s for s in engine.scheduler.running}
    shared = (len(engine.tokenize(PROMPT)) - 1) // 4
    assert len(seqs) == 3 and shared > 0
    head = seqs[0].block_table[:shared]
    for s in seqs.values():
        assert s.block_table[:shared] == head
    assert all(engine.block_manager.ref_counts[b] == 3 for b in head)
    own = [s.block_table[shared] for s in seqs.values()]
    assert len(set(own)) == 3  # copy-on-write: each writes its next positions into its own block
    run_to_completion(engine)
    assert_no_blocks_used(engine)


def test_best_of_returns_the_n_likeliest(tiny_llama):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=9, n=2, best_of=5, ignore_eos=True)
    engine = make_engine(tiny_llama)
    outs = samples(engine, "r", PROMPT, params)
    assert sorted(outs) == [0, 1] and outs[0].logprobs is None
    scored = []
    for i in range(5):
        alone = samples(make_engine(tiny_llama), "x", PROMPT, replace(params.for_sample(i), logprobs=0))[0]
        scored.append((alone.cumulative_logprob, alone.token_ids))
    best = sorted(scored, reverse=True)[:2]
    assert [outs[0].token_ids, outs[1].token_ids] == [b[1] for b in best]
    assert outs[0].cumulative_logprob == pytest.approx(best[0][0], abs=1e-4)
    assert outs[0].cumulative_logprob >= outs[1].cumulative_logprob
    assert_no_blocks_used(engine)


def test_greedy_samples_agree_and_llm_generate_returns_them_all(tiny_llama):
    from engine import LLM

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=256, block_size=4)
    one, three = llm.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0, n=3, ignore_eos=True),
        ],
    )
    assert one.samples is None and [s.index for s in three.samples] == [0, 1, 2]
    assert all(s.token_ids == one.token_ids for s in three.samples)


def test_abort_and_preemption_free_every_sample(tiny_llama):
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=1, n=4, ignore_eos=True)
    want = samples(make_engine(tiny_llama), "r", PROMPT, params)
    engine = make_engine(tiny_llama, num_kv_blocks=40)  # too few for 4 samples of 30 tokens: preemption
    got = samples(engine, "r", PROMPT, params)
    assert engine.scheduler.num_preemptions > 0
    assert {i: o.token_ids for i, o in got.items()} == {i: o.token_ids for i, o in want.items()}
    assert_no_blocks_used(engine)

    engine.add_request("a", PROMPT, params)
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 4
    assert engine.abort_request("a")
    assert not engine.has_unfinished() and not engine.groups
    assert_no_blocks_used(engine)


def test_samples_fork_on_the_engine_that_imports_the_kv(tiny_llama):
    """The decode side of a transfer: one prefill's KV, imported once, serves every sample."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True)
    want = samples(make_engine(tiny_llama), "r", PROMPT, params)
    prefill = make_engine(tiny_llama)
    prefill.add_prefill("x", PROMPT, replace(params, n=1, max_tokens=1))
    run_to_completion(prefill)  # its token is not used: every sample draws its first token on the decode side
    ids = prefill.tokenize(PROMPT)
    decode = make_engine(tiny_llama)
    blocks = decode.reserve_kv(len(ids))
    decode.kv_cache.import_kv(blocks, prefill.export_kv("x"))
    prefill.release_kv("x")
    decode.add_prefilled_request("x", ids, [], params, blocks)
    got = {}
    while decode.has_unfinished():
        got.update({o.index: o for o in decode.step() if o.finished})
    assert {i: o.token_ids for i, o in got.items()} == {i: o.token_ids for i, o in want.items()}
    assert_no_blocks_used(decode)


def test_bad_sample_counts_are_named(tiny_llama):
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="best_of must be"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=17)
    engine = make_engine(tiny_llama)
    with pytest.raises(
        ValueError, match="n, best_of and beam_width must be 1 for a prefill to export or a migrated request"
    ):
        engine.add_prefill("x", PROMPT, SamplingParams(n=2))
    assert not engine.has_unfinished() and not engine.groups


@pytest.mark.parametrize(
    "placement", [dict(), dict(kv_layerwise="on"), dict(local_prefill="always")], ids=["remote", "layerwise", "local"]
)
def test_samples_through_the_router_one_prefill_one_transfer(tiny_llama, placement):
    """n = 3 over gRPC: every sample as the engine alone draws it, the prompt prefilled once and
    its KV moved once; streamed messages carry their sample's index, each ends once."""
    import asyncio

    from cluster import local_cluster, wait_for_no_blocks

    from router.client import AsyncClient

    params = dict(max_tokens=10, temperature=1.0, seed=21, ignore_eos=True)
    want = samples(make_engine(tiny_llama), "r", PROMPT, SamplingParams(n=3, **params))

    async def scenario():
        async with local_cluster(tiny_llama, **placement) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                result = await client.generate(PROMPT, n=3, logprobs=1, **params)
                assert [s.token_ids for s in result.samples] == [want[i].token_ids for i in range(3)]
                assert all(len(s.logprobs) == 10 and s.finish_reason == "length" for s in result.samples)
                assert result.usage["completion_tokens"] == 30
                ends = Counter()
                async for part in client.stream(PROMPT, n=3, **params):
                    ends[part.index] += bool(part.finish_reason)
                assert ends == {0: 1, 1: 1, 2: 1}
            # Two requests, each prefilled once (remotely, or on the decode node) and imported once.
            num_prompt = len(make_engine(tiny_llama).tokenize(PROMPT))
            local = placement.get("local_prefill") == "always"
            assert prefills[0].llm.num_prompt_tokens == (0 if local else 2 * num_prompt)
            assert decodes[0].llm.num_prompt_tokens == 2 * num_prompt
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())
