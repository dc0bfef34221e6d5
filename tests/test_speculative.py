"""Speculative decoding (n-gram proposer): the same tokens as decoding without it, fewer steps."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import numpy as np
import pytest
from cluster import local_cluster, wait_for_no_blocks
from conftest import assert_no_blocks_used, make_engine, run_to_completion

from engine import EngineConfig, SamplingParams
from engine.block_manager import block_hashes
from engine.sequence import Sequence
from engine.speculative import NgramProposer, SpeculativeConfig, ngram_draft
from router.client import AsyncClient

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
# Prompts that repeat themselves, so drafts exist, and one that does not.
PROMPTS = {
    "fox": "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over",
    "hello": "Hello world! Hello world! Hello world! Hello",
    "digits": "0123456789 0123456789 0123",
    "plain": "Paged attention stores",
}


def generate(engine, prompts: dict, params) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params[rid] if isinstance(params, dict) else params)
    return run_to_completion(engine)


def test_ngram_draft_takes_the_longest_suffix_at_its_latest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    assert ngram_draft(tokens, 3, 1, 4) == [7, 5, 2]  # "2 3" last seen before 7
    assert ngram_draft(tokens, 6, 1, 4) == [9, 1, 2, 3, 7, 5]  # the latest with 6 tokens after it
    assert ngram_draft(tokens, 10, 1, 4) == [9, 1, 2, 3, 7, 5, 2, 3]  # none: the first, as far as it goes
    assert ngram_draft(np.array([4, 5, 6]), 3, 1, 3) == []  # nothing repeats
    assert ngram_draft(np.array([1, 2, 1, 2]), 2, 3, 3) == []  # shorter than prompt_lookup_min
    assert ngram_draft(np.array([8, 1, 2, 1, 2]), 2, 2, 3) == [1, 2]


def test_settings_are_checked_and_named():
    with pytest.raises(ValueError, match="speculative.num_speculative_tokens"):
        EngineConfig(speculative={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['k'\]"):
        EngineConfig(speculative={"k": 3})
    with pytest.raises(ValueError, match="speculative.method"):
        EngineConfig(speculative={"method": "medusa"})
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        EngineConfig(speculative={"prompt_lookup_min": 3, "prompt_lookup_max": 2})


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.2, top_k=20, top_p=0.9, seed=11, ignore_eos=True, logprobs=2),
    ],
    ids=["greedy", "seeded"],
)
def test_same_tokens_and_logprobs_as_without_drafts(tiny_llama, params):
    base = generate(make_engine(tiny_llama), PROMPTS, params)
    engine = make_engine(tiny_llama, speculative=NGRAM)
    spec = generate(engine, PROMPTS, params)
    for rid in PROMPTS:
        assert spec[rid].token_ids == base[rid].token_ids, rid
        assert spec[rid].text == base[rid].text
        if params.logprobs is not None:
            for a, b in zip(spec[rid].logprobs, base[rid].logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    # Drafts were made, some kept and some rejected (rolled back), and no block was stranded.
    assert engine.num_accepted_tokens > 0 and engine.num_draft_tokens > engine.num_accepted_tokens
    assert_no_blocks_used(engine)


def test_fewer_steps_when_the_output_copies(tiny_llama):
    """A random model loops; the proposer copies the loop, so each step emits several tokens."""
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    engine = make_engine(tiny_llama, speculative={"method": "ngram", "num_speculative_tokens": 6})
    engine.add_request("x", PROMPTS["hello"], params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert engine.num_accepted_tokens / engine.num_draft_tokens > 0.5
    assert steps < 0.75 * 64


def test_stops_inside_an_accepted_draft(tiny_llama):
    """A stop token, a stop string or max_tokens that falls inside the drafts ends the output there."""
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    base = generate(make_engine(tiny_llama), {"x": PROMPTS["hello"]}, greedy)["x"]
    stop_id, stop_text = base.token_ids[20], base.text[-12:-6]
    cases = {
        "token": SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,)),
        "string": SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop_text,)),
        "length": SamplingParams(max_tokens=23, temperature=0, ignore_eos=True),
    }
    prompts = {name: PROMPTS["hello"] for name in cases}
    want = generate(make_engine(tiny_llama), prompts, cases)
    engine = make_engine(tiny_llama, speculative={"method": "ngram", "num_speculative_tokens": 8})
    got = generate(engine, prompts, cases)
    for name in cases:
        assert got[name].token_ids == want[name].token_ids, name
        assert (got[name].text, got[name].finish_reason) == (want[name].text, want[name].finish_reason), name
    assert got["token"].token_ids[-1] == stop_id and len(got["length"].token_ids) == 23
    assert engine.num_accepted_tokens > 0
    assert_no_blocks_used(engine)


def test_continuous_batching_preemption_and_imported_kv(tiny_llama):
    """Sequences with and without drafts share steps with prefills arriving later; a pool too small
    for all of them preempts; a sequence admitted with KV computed elsewhere speculates too."""
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    late = {"late": "Prefill is compute-bound; decode is memory-bound."}
    want = generate(make_engine(tiny_llama), {**PROMPTS, **late}, params)
    engine = make_engine(tiny_llama, speculative=NGRAM, num_kv_blocks=48)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    done = {}
    for step in range(10_000):
        if step == 3:
            engine.add_request("late", late["late"], params)
        if not engine.has_unfinished():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions > 0 and engine.num_accepted_tokens > 0
    assert {rid: o.token_ids for rid, o in done.items()} == {rid: o.token_ids for rid, o in want.items()}
    assert_no_blocks_used(engine)

    # The decode side of a transfer: the prompt's KV imported, the first token sampled elsewhere.
    prefill = make_engine(tiny_llama)
    prefill.add_prefill("x", PROMPTS["hello"], SamplingParams(max_tokens=1, temperature=0))
    first = run_to_completion(prefill)["x"].token_ids
    ids = prefill.tokenize(PROMPTS["hello"])
    decode = make_engine(tiny_llama, speculative=NGRAM)
    blocks = decode.reserve_kv(len(ids))
    decode.kv_cache.import_kv(blocks, prefill.export_kv("x"))
    prefill.release_kv("x")
    decode.add_prefilled_request("x", ids, first, params, blocks)
    assert run_to_completion(decode)["x"].token_ids == want["hello"].token_ids
    assert decode.num_accepted_tokens > 0
    assert_no_blocks_used(decode)


class FixedProposer:
    """Drafts the same tokens for every sequence: the positions after its first token."""

    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def propose(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            done = len(seq.output_token_ids)
            decoding = seq.num_tokens - seq.num_computed_tokens == 1
            seq.draft_token_ids = self.drafts[done - 1 : seq.params.max_tokens - 1] if decoding else []

    def observe(self, seq, num_drafted, num_accepted) -> None:
        pass


def samples(model, seed: int, n: int, drafts: list[int] | None = None) -> tuple[Counter, object]:
    """n unseeded samples of a 3-token continuation (top-3 of each position), counted; and the engine."""
    engine = make_engine(model, seed=seed, max_num_seqs=512)
    if drafts:
        engine.proposer = FixedProposer(drafts)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    outs = generate(engine, {f"s{i}": PROMPTS["hello"] for i in range(n)}, params)
    return Counter(tuple(o.token_ids) for o in outs.values()), engine


def total_variation(a: Counter, b: Counter) -> float:
    n, m = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / n - b[k] / m) for k in set(a) | set(b))


def test_the_sampled_distribution_is_unchanged(tiny_llama, monkeypatch):
    """Unseeded sampling: with and without drafts the noise is drawn differently, so the runs are
    independent samples. Drafting each sequence's likeliest 2nd and 3rd tokens, the distribution of
    continuations stays as close to one without drafts as another run without drafts is, while a
    broken rule that ignores rejections moves it."""
    n = 2000
    (without, _), (again, _) = samples(tiny_llama, 1, n), samples(tiny_llama, 2, n)
    noise = total_variation(without, again)
    likeliest = [Counter(c[i] for c in without.elements()).most_common(1)[0][0] for i in (1, 2)]
    spec, engine = samples(tiny_llama, 3, n, likeliest)
    assert engine.num_draft_tokens > n and 0.1 < engine.num_accepted_tokens / engine.num_draft_tokens < 0.9
    assert total_variation(spec, without) < 1.5 * noise, (total_variation(spec, without), noise)

    from engine import model_runner

    monkeypatch.setattr(model_runner, "first_rejected", lambda drafts, sampled: len(drafts))
    broken, _ = samples(tiny_llama, 3, n, likeliest)
    assert total_variation(broken, without) > 2 * noise, (total_variation(broken, without), noise)


def test_the_proposer_backs_off_when_drafts_fail():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, min_acceptance=0.3, pause_steps=5), 1000)
    seq = Sequence("x", [1, 2, 3] * 4 + [1, 2], SamplingParams(max_tokens=100))
    seq.num_computed_tokens = seq.num_tokens - 1

    def draft_len() -> int:
        proposer.propose([seq])
        return len(seq.draft_token_ids)

    assert draft_len() == 4
    proposer.observe(seq, 4, 0)  # acceptance 0.7: shorter drafts
    assert draft_len() == 3
    proposer.observe(seq, 3, 0)  # 0.49
    assert draft_len() == 2
    proposer.observe(seq, 2, 0)  # 0.34
    proposer.observe(seq, 1, 0)  # 0.24 < 0.3: a pause
    assert [draft_len() for _ in range(5)] == [0] * 5
    assert draft_len() == 1  # on probation
    proposer.observe(seq, 1, 1)  # 0.51
    assert draft_len() == 2
    # Never past max_tokens: emitted = accepted + 1.
    seq.output_token_ids = [0] * 98
    assert draft_len() <= 1


@pytest.mark.parametrize(
    "params, local_prefill",
    [
        (dict(max_tokens=40, temperature=0, ignore_eos=True), "off"),
        (dict(max_tokens=40, temperature=0.2, seed=3, ignore_eos=True), "off"),  # low: drafts get accepted
        (dict(max_tokens=40, temperature=0.2, seed=3, ignore_eos=True), "auto"),
    ],
    ids=["greedy", "seeded", "seeded-local-prefill-auto"],
)
def test_a_decode_node_speculates_across_the_split(tiny_llama, params, local_prefill):
    """Through the router and a real transfer (or, with auto, wherever the router places the
    prefill, as users run it): the decode node drafts and verifies, the client sees the tokens of
    decoding without it (greedy, and seeded sampling: fp32), several per stream message."""
    want = generate(make_engine(tiny_llama), PROMPTS, SamplingParams(**params))

    async def scenario():
        async with local_cluster(tiny_llama, decode_engine={"speculative": NGRAM}, local_prefill=local_prefill) as (
            router,
            prefills,
            decodes,
        ):
            async with AsyncClient(router.address) as client:
                for rid, prompt in PROMPTS.items():
                    result = await client.generate(prompt, **params, logprobs=1)
                    assert result.token_ids == want[rid].token_ids, rid
                    assert len(result.logprobs) == len(result.token_ids)
            engine = decodes[0].llm
            assert engine.num_accepted_tokens > 0
            node = decodes[0]
            node.exporter.refresh()
            rate = node.metrics.sample("pdserve_spec_decode_acceptance_rate", role="decode")
            assert rate == pytest.approx(engine.num_accepted_tokens / engine.num_draft_tokens)
            assert node.metrics.sample("pdserve_spec_decode_tokens_per_verification", role="decode") > 1
            assert (
                node.metrics.sample("pdserve_spec_decode_draft_tokens_total", role="decode") == engine.num_draft_tokens
            )
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """Another tiny random model with the same tokenizer: a draft model that mostly disagrees."""
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True, logprobs=1),
    ],
    ids=["greedy", "seeded"],
)
def test_a_draft_model_gives_the_same_tokens(tiny_llama, tiny_draft, params):
    base = generate(make_engine(tiny_llama), PROMPTS, params)
    for draft, name in ((tiny_llama, "itself"), (tiny_draft, "another model")):
        engine = make_engine(
            tiny_llama,
            num_kv_blocks=64,  # small enough to preempt
            speculative={"method": "draft_model", "draft_model": str(draft)},
        )
        spec = generate(engine, PROMPTS, params)
        assert {r: o.token_ids for r, o in spec.items()} == {r: o.token_ids for r, o in base.items()}, name
        assert engine.num_draft_tokens > 0 and engine.scheduler.num_preemptions > 0
        if draft is tiny_llama and params.greedy:  # drafting for itself, greedy: every draft holds
            assert engine.num_accepted_tokens == engine.num_draft_tokens
        assert_no_blocks_used(engine)


def test_drafts_the_step_has_no_room_for_are_dropped_and_drafted_again(tiny_llama):
    """A token budget too small for every sequence's drafts: the scheduler verifies some and drops
    the rest, whose draft KV must then catch up from the last token again (it once ran a span of
    negative length)."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = PROMPTS | {rid + "-again": prompt + " again" for rid, prompt in PROMPTS.items()}
    base = generate(make_engine(tiny_llama), prompts, params)
    engine = make_engine(
        tiny_llama,
        max_num_batched_tokens=6,  # one verification of 3 drafts, and 2 more tokens
        speculative={"method": "draft_model", "draft_model": str(tiny_llama), "num_speculative_tokens": 3},
    )
    spec = generate(engine, prompts, params)
    assert {r: o.token_ids for r, o in spec.items()} == {r: o.token_ids for r, o in base.items()}
    assert 0 < engine.num_draft_tokens and engine.num_verifications < engine.num_generated_tokens
    assert_no_blocks_used(engine)


def test_draft_model_settings_are_checked(tiny_llama, tmp_path):
    from tiny_models import make_tiny_model

    with pytest.raises(ValueError, match="speculative.draft_model"):
        EngineConfig(speculative={"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative.draft_model"):
        EngineConfig(speculative={"method": "ngram", "draft_model": "x"})
    other_vocab = make_tiny_model(tmp_path / "v", vocab_size=300)
    with pytest.raises(ValueError, match=r"vocabulary \(300 tokens\) must be the target's \(320\)"):
        make_engine(tiny_llama, speculative={"method": "draft_model", "draft_model": str(other_vocab)})


def assert_blocks_named_by_their_tokens(engine) -> None:
    """Every name a sequence gave its full blocks is the hash of the tokens they hold."""
    bs = engine.block_manager.block_size
    for seq in [*engine.scheduler.running, *engine.scheduler.waiting]:
        want = block_hashes(seq.token_ids(0, seq.num_tokens), bs)
        assert seq.block_hashes == want[: len(seq.block_hashes)], seq.request_id


def test_a_next_turn_over_a_speculative_answer_hits_every_block(tiny_llama):
    """Blocks filled by accepted drafts are named after their tokens (they were named before the
    drafts joined the output: a next turn found fewer cached tokens than without speculation)."""
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    hits = {}
    for name, kwargs in {"plain": {}, "ngram": {"speculative": NGRAM}}.items():
        engine = make_engine(tiny_llama, **kwargs)
        answer = generate(engine, {"x": PROMPTS["hello"]}, params)["x"]
        turn = engine.tokenize(PROMPTS["hello"]) + answer.token_ids + engine.tokenize(" Again:")
        names = block_hashes(turn[:-1], engine.block_manager.block_size)
        hits[name] = sum(1 for _ in itertools.takewhile(engine.block_manager.cached.__contains__, names))
    assert engine.num_accepted_tokens > 0
    assert hits["ngram"] == hits["plain"] >= (len(engine.tokenize(PROMPTS["hello"])) + 63) // 4


def test_shared_prefixes_with_different_drafts_and_preemption(tiny_llama):
    """Sequences sharing a prefix accept different drafts at the same positions, in a pool small
    enough to preempt them: each block keeps the name of its own tokens, so a preempted sequence
    is never handed another's KV (fp32: the same tokens as without speculation)."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    stem = "Hello world! Hello world! Hello world! "
    prompts = {
        f"{i}": stem + tail
        for i, tail in enumerate(["Hello", "Hello world", "0123 0123 01", "fox fox", "Hello world! Hello"])
    }
    want = generate(make_engine(tiny_llama), prompts, params)
    engine = make_engine(tiny_llama, speculative=NGRAM, num_kv_blocks=56)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        assert_blocks_named_by_their_tokens(engine)
    assert engine.scheduler.num_preemptions > 0 and engine.num_accepted_tokens > 0
    assert engine.block_manager.num_hit_tokens > 0
    assert {rid: o.token_ids for rid, o in done.items()} == {rid: o.token_ids for rid, o in want.items()}
    assert_no_blocks_used(engine)
