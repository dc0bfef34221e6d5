"""OpenAI's and vLLM's sampling parameters beyond temperature, top-k and top-p: presence, frequency
and repetition penalties, logit_bias, min_p, min_tokens and bad words. Greedy tokens equal a
reference written out from the definitions over transformers' fp32 logits, a token at a time;
each request in a batch, under speculation, and through the P/D split equals itself alone."""

from __future__ import annotations

import pytest
import torch
from cluster import split_results
from conftest import engine_alone, make_engine
from hypothesis import given, settings
from hypothesis import strategies as st
from test_model_equality import PROMPTS
from transformers import AutoModelForCausalLM

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

# Values exact in float32 (the wire's width), so the engine alone and a cluster see the same numbers.
PENALTIES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.75),
    "repetition": dict(repetition_penalty=1.25),
    "negative-presence": dict(presence_penalty=-0.5),  # rewards repeating
    "logit-bias": dict(logit_bias={7: 3.5, 90: -100.0, 11: 2.0}),
    "bad-words": dict(bad_words_token_ids=((83,), (17, 288), (187, 137), (294, 3, 294))),  # what greedy says
    "all": dict(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5, logit_bias={3: 1.0}),
}
GREEDY = dict(max_tokens=14, temperature=0, ignore_eos=True)


def reference_tokens(hf, prompt: list[int], max_tokens: int, **p) -> list[int]:
    """The definitions, one token at a time (vLLM's order: bad words, logit_bias, then repetition,
    frequency and presence penalties)."""
    out: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        for word in p.get("bad_words_token_ids", ()):
            if len(word) == 1 or out[len(out) - len(word) + 1 :] == list(word[:-1]):
                logits[word[-1]] = float("-inf")
        for token, bias in p.get("logit_bias", {}).items():
            logits[token] += bias
        for token in set(prompt + out):
            if p.get("repetition_penalty", 1.0) != 1.0 and (token in prompt or token in out):
                r = p["repetition_penalty"]
                logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
        for token in set(out):
            logits[token] -= p.get("frequency_penalty", 0.0) * out.count(token) + p.get("presence_penalty", 0.0)
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_greedy_tokens_equal_the_definitions_over_transformers_logits(tiny_llama, name):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ours = engine_alone(tiny_llama, PROMPTS, **GREEDY, **PENALTIES[name])  # batched in one engine
    plain = engine_alone(tiny_llama, PROMPTS, **GREEDY)
    for prompt, tokens in zip(PROMPTS, ours):
        assert tokens == reference_tokens(hf, prompt, 14, **PENALTIES[name]), name
    assert ours != plain, "the parameters changed nothing: the test would not see them ignored"


def test_penalties_take_effect_in_expected_directions(tiny_llama):
    """Sanity on the semantics: a strong presence penalty leaves no token twice among the first
    few; +100 on one id makes it every token; bad words never appear."""
    prompt = PROMPTS[0]
    (spread,) = engine_alone(tiny_llama, [prompt], **GREEDY, presence_penalty=2.0, frequency_penalty=2.0)
    assert len(set(spread[:6])) == 6
    (forced,) = engine_alone(tiny_llama, [prompt], **GREEDY, logit_bias={"42": 100})
    assert forced == [42] * 14
    (plain,) = engine_alone(tiny_llama, [prompt], **GREEDY)
    banned = tuple((t,) for t in set(plain))
    (avoided,) = engine_alone(tiny_llama, [prompt], **GREEDY, bad_words_token_ids=banned)
    assert not set(avoided) & set(plain)


def test_min_tokens_holds_back_eos_and_stop_ids_and_stop_strings(tiny_llama):
    """The first greedy token as a stop id: without min_tokens the output ends at once; with
    min_tokens 5, it cannot be sampled (nor EOS) before 5 tokens are out."""
    (plain,) = engine_alone(tiny_llama, [PROMPTS[0]], **GREEDY)
    (ended,) = engine_alone(tiny_llama, [PROMPTS[0]], max_tokens=14, temperature=0, stop_token_ids=[plain[0]])
    assert ended == [plain[0]]
    (held,) = engine_alone(
        tiny_llama, [PROMPTS[0]], max_tokens=14, temperature=0, stop_token_ids=[plain[0]], min_tokens=5
    )
    assert len(held) > 5 and plain[0] not in held[:5]
    assert held[-1] == plain[0] or len(held) == 14


def test_min_p_keeps_only_tokens_near_the_top():
    """Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps the two of at least 0.25; many seeds draw both."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None].repeat(64, 1)
    sampler = Sampler(0, torch.device("cpu"))
    params = [SamplingParams(temperature=1.0, min_p=0.5, seed=s) for s in range(64)]
    drawn = set(sampler(logits, params, [0] * 64).token_ids)
    assert drawn == {0, 1}
    loose = [SamplingParams(temperature=1.0, seed=s) for s in range(64)]
    assert len(set(sampler(logits, loose, [0] * 64).token_ids)) > 2


MIXED = [
    SamplingParams(**GREEDY, presence_penalty=1.5),
    SamplingParams(**GREEDY, repetition_penalty=1.25, logit_bias={5: 1.5}),
    SamplingParams(max_tokens=14, temperature=1.0, seed=7, frequency_penalty=0.75, min_p=0.25),
    SamplingParams(max_tokens=14, temperature=0.5, seed=3, top_k=20, bad_words_token_ids=((33,), (17, 5))),
    SamplingParams(max_tokens=14, temperature=0, min_tokens=4, stop_token_ids=[5, 17, 33]),
    SamplingParams(**GREEDY),
]


def _alone(model, prompt, params) -> list[int]:
    engine = make_engine(model)
    engine.add_request("r", prompt, params)
    out = []
    while engine.has_unfinished():
        out += [o for o in engine.step() if o.last]
    return out[0].token_ids


@pytest.mark.parametrize(
    "speculative",
    [None, {"method": "ngram", "num_speculative_tokens": 3}, "self"],
    ids=["plain", "ngram", "self-draft"],
)
def test_each_request_of_a_batch_equals_itself_alone(tiny_llama, speculative):
    """Penalized, biased, min_p'd and plain requests batched (fp32), with drafts verified: a
    verification's rows count the drafts before them as output."""
    if speculative == "self":  # drafts the target accepts, whatever the penalties do to them
        speculative = {"method": "draft_model", "draft_model": str(tiny_llama), "num_speculative_tokens": 3}
    engine = make_engine(tiny_llama, speculative=speculative)
    prompts = [PROMPTS[i % len(PROMPTS)] + [11, 12, 13, 11, 12, 13] for i in range(len(MIXED))]
    for i, (prompt, params) in enumerate(zip(prompts, MIXED)):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o.token_ids for o in engine.step() if o.last}
    for i, (prompt, params) in enumerate(zip(prompts, MIXED)):
        assert done[str(i)] == _alone(tiny_llama, prompt, params), params
    if speculative:
        assert engine.num_accepted_tokens > 0


@pytest.mark.parametrize("transport, local_prefill", [("shm", "off"), ("tcp", "off"), ("tcp", "always")])
def test_the_pd_split_gives_the_engines_tokens(tiny_llama, transport, local_prefill):
    """The first token sampled on the prefill node (its output empty), the rest on the decode
    node (the first one counted): the same tokens as one engine alone, n > 1 included."""
    cases = [(PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(MIXED)]
    forked = SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3, presence_penalty=2.0)
    *results, many = split_results(
        tiny_llama, cases + [(PROMPTS[0], forked)], kv_transport=transport, local_prefill=local_prefill
    )
    assert [r.token_ids for r in results] == [_alone(tiny_llama, prompt, params) for prompt, params in cases]
    assert len(many.samples) == 3
    for sample in many.samples:
        assert len(set(sample.token_ids)) == len(sample.token_ids)  # presence 2.0: no repeats here


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
        (dict(frequency_penalty="x"), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(repetition_penalty=0), r"repetition_penalty must be in \(0, 10.0\]"),
        (dict(logit_bias={1: 101}), r"logit_bias: at most 1024 token ids >= 0, each biased by \[-100, 100\]"),
        (dict(logit_bias={"a": 1}), r"logit_bias must map token ids to numbers"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(min_tokens=20, max_tokens=10), r"min_tokens must be in \[0, max_tokens 10\], got 20"),
        (
            dict(bad_words_token_ids=((),)),
            r"bad_words: at most 512 token sequences \(256 words, two spellings each\), each of one or more token ids",
        ),
        (dict(beam_width=2, presence_penalty=1.0), r"beam search takes no penalties"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocabulary_are_refused_before_any_work(tiny_llama):
    engine = make_engine(tiny_llama)
    for params, field in [
        (SamplingParams(logit_bias={10_000: 1.0}), "logit_bias"),
        (SamplingParams(bad_words_token_ids=((5, 10_000),)), "bad_words"),
    ]:
        with pytest.raises(ValueError, match=rf"{field}: token ids must be below the vocabulary size 320"):
            engine.add_request("r", PROMPTS[0], params)
    assert not engine.has_unfinished()


def test_under_min_tokens_a_stop_string_in_earlier_text_never_cuts_it_later():
    """Only stop strings reaching into the newest text end the output: one written while
    min_tokens held stops back is not found again afterwards (as vLLM)."""
    from engine.detokenizer import IncrementalDetokenizer

    class Chars:  # token i is the character chars[i]
        chars = "a\nbc"

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.chars[i] for i in ids)

    detok = IncrementalDetokenizer(Chars(), [], ("\n", "STOPSTOP"), min_tokens=3)
    stopped = [detok.add(i)[1] for i in range(4)]
    assert stopped == [False, False, False, False] and detok.text == "a\nbc"


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.integers(0, 40), max_size=12),  # prompt (ids past the vocabulary of 32 ignored)
            st.lists(st.integers(0, 40), max_size=12),  # output so far
            st.sampled_from([1.0, 1.25, 0.8]),
            st.sampled_from([0.0, 0.75, -0.5]),
            st.sampled_from([0.0, 1.5, -1.0]),
        ),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 1000),
)
def test_the_penalties_equal_their_definition_on_whole_rows(rows, seed):
    """Only the tokens a row's history holds are touched: bit-equal to the definitions applied to
    every token of every row (fp32)."""
    from engine.penalties import apply_penalties

    vocab = 32
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 4
    params = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p) for _, _, r, f, p in rows]
    got = apply_penalties(logits.clone(), params, [r[0] for r in rows], [r[1] for r in rows], ())
    want = logits.clone()
    for i, (prompt, output, rep, freq, pres) in enumerate(rows):
        counts = torch.bincount(torch.tensor([t for t in output if t < vocab], dtype=torch.long), minlength=vocab)
        seen = (counts > 0) | (
            torch.bincount(torch.tensor([t for t in prompt if t < vocab], dtype=torch.long), minlength=vocab) > 0
        )
        row = want[i]
        if rep != 1:
            row = torch.where(seen, torch.where(row > 0, row / rep, row * rep), row)
        want[i] = row - freq * counts.float() - pres * (counts > 0).float()
    assert torch.equal(got, want)
