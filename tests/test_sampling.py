"""Sampling semantics: candidate sets, seeds, logprobs, and the ways a request stops."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_no_blocks_used, make_engine, run_to_completion

from engine import SamplingParams
from engine.sampler import Sampler, apply_top_k_top_p

PROMPT = [5, 17, 33, 8, 90, 41, 7]
OTHER = [200, 3, 9, 12]


def kept(logits: list[float], k: int, p: float) -> set[int]:
    out = apply_top_k_top_p(torch.tensor([logits]), torch.tensor([k]), torch.tensor([p]))
    return {i for i, v in enumerate(out[0].tolist()) if v != -math.inf}


PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = [math.log(x) for x in PROBS]


def test_top_k_keeps_the_k_most_likely_and_ties():
    assert kept(LOGITS, 1, 1.0) == {0}
    assert kept(LOGITS, 2, 1.0) == {0, 1}
    assert kept(LOGITS, 0, 1.0) == {0, 1, 2, 3}  # 0 disables
    assert kept(LOGITS, 99, 1.0) == {0, 1, 2, 3}
    assert kept([1.0, 2.0, 2.0, 0.0], 2, 1.0) == {1, 2}
    assert kept([1.0, 2.0, 1.0, 0.0], 2, 1.0) == {0, 1, 2}  # tied with the 2nd: kept


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(LOGITS, 0, 0.45) == {0}
    assert kept(LOGITS, 0, 0.55) == {0, 1}
    assert kept(LOGITS, 0, 0.79) == {0, 1}
    assert kept(LOGITS, 0, 0.81) == {0, 1, 2}
    assert kept(LOGITS, 0, 1.0) == {0, 1, 2, 3}
    assert kept([0.0, -100.0], 0, 1e-6) == {0}  # always at least one


def test_top_p_applies_after_top_k():
    # Renormalized over the top 2, token 0 has 0.625 >= 0.6, so top-p keeps it alone. Top-p on
    # the full distribution first would have kept {0, 1} (0.5 < 0.6).
    assert kept(LOGITS, 2, 0.6) == {0}


def test_sampled_tokens_follow_the_filtered_distribution():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    n = 4000
    logits = torch.tensor([LOGITS] * n)
    params = [SamplingParams(temperature=1.0, top_k=3, top_p=0.9)] * n
    tokens = sampler(logits, params, [0] * n).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=4).tolist()
    assert counts[3] == 0  # cut by top_k=3
    expected = [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]  # top_p=0.9 keeps all three after top-k
    for c, e in zip(counts, expected):
        assert abs(c / n - e) < 0.03, counts


def test_greedy_rows_and_random_rows_in_one_batch():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.tensor([LOGITS, LOGITS[::-1]] * 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 50
    tokens = sampler(logits, params, [0] * 100).token_ids
    assert all(t == 0 for t in tokens[0::2])
    assert len(set(tokens[1::2])) > 1


def generate(engine, prompts: dict, params: SamplingParams) -> dict:
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    return {rid: o for rid, o in run_to_completion(engine).items()}


def test_same_seed_same_tokens_whatever_the_batch(tiny_llama):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = generate(make_engine(tiny_llama, seed=1), {"x": PROMPT}, seeded)["x"].token_ids
    engine = make_engine(tiny_llama, seed=2)  # a different engine seed, busy with other requests
    engine.add_request("noise", OTHER, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True))
    engine.step()
    with_others = generate(engine, {"x": PROMPT}, seeded)["x"].token_ids
    assert alone == with_others
    other_seed = generate(
        make_engine(tiny_llama), {"x": PROMPT}, SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    )["x"].token_ids
    assert other_seed != alone


def test_seeded_sampling_survives_preemption_and_kv_transfer(tiny_llama):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    ref = generate(make_engine(tiny_llama), {"x": PROMPT}, seeded)["x"].token_ids
    tight = make_engine(tiny_llama, num_kv_blocks=8, block_size=4)
    outs = generate(tight, {"x": PROMPT, "y": OTHER, "z": PROMPT[::-1]}, seeded)
    assert tight.scheduler.num_preemptions > 0
    assert outs["x"].token_ids == ref
    prefill, decode = make_engine(tiny_llama), make_engine(tiny_llama)
    prefill.add_prefill("x", PROMPT, SamplingParams(max_tokens=1, temperature=1.0, seed=7))
    first = run_to_completion(prefill)["x"].token_ids
    blocks = decode.reserve_kv(len(PROMPT))
    decode.kv_cache.import_kv(blocks, prefill.export_kv("x"))
    prefill.release_kv("x")
    decode.add_prefilled_request("x", PROMPT, first, seeded, blocks)
    assert run_to_completion(decode)["x"].token_ids == ref


def test_logprobs_are_the_model_distribution(tiny_llama):
    engine = make_engine(tiny_llama)
    recorded = []
    forward = engine.runner.forward
    engine.runner.forward = lambda batch: (lambda r: (recorded.append(r[2].clone()), r)[1])(forward(batch))
    out = generate(
        engine, {"x": PROMPT}, SamplingParams(max_tokens=4, temperature=0.8, seed=3, logprobs=3, ignore_eos=True)
    )["x"]
    assert len(out.logprobs) == 4
    for token_id, entry, logits in zip(out.token_ids, out.logprobs, recorded):
        ref = torch.log_softmax(logits[0], -1)
        top = ref.topk(3)
        assert token_id in entry
        assert set(top.indices.tolist()) <= set(entry) and len(entry) <= 4
        for t, lp in entry.items():
            assert lp == pytest.approx(ref[t].item(), abs=1e-5)


def test_an_output_is_a_snapshot_the_next_step_does_not_change(tiny_llama):
    """A node's engine thread steps on while the event loop still sends the last output: its
    logprobs must stay those of its own tokens (they were the live list: a stream now and then
    carried the next token's logprobs in place of its own)."""
    engine = make_engine(tiny_llama)
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))
    outs = [o for _ in range(6) for o in engine.step()]
    assert [len(o.token_ids) for o in outs] == [len(o.logprobs) for o in outs] == [1, 2, 3, 4, 5, 6]
    assert all(o.new_token_ids[-1] in o.logprobs[-1] for o in outs)


def test_stop_string_cuts_the_text_before_it(tiny_llama):
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = generate(make_engine(tiny_llama), {"x": PROMPT}, greedy)["x"]
    # A three-character stop string from the middle of the greedy text (random weights also emit
    # incomplete UTF-8, shown as U+FFFD; avoid those).
    cut = next(
        i
        for i in range(2, len(full.text) - 3)
        if "\ufffd" not in full.text[i : i + 3] and full.text.find(full.text[i : i + 3]) == i
    )
    stop = full.text[cut : cut + 3]
    engine = make_engine(tiny_llama)
    streamed = []
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))
    while engine.has_unfinished():
        for o in engine.step():
            streamed.append(o.new_text)
            out = o
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert "".join(streamed) == out.text  # streaming never leaks part of the stop string
    assert len(out.token_ids) < 20
    assert_no_blocks_used(engine)
    # max_tokens ending on the very token that completes the stop string: it stopped (as in vLLM),
    # text cut; a prefill node (max_tokens 1 for the first token) relies on it to end the request
    at_max = SamplingParams(max_tokens=len(out.token_ids), temperature=0, ignore_eos=True, stop=[stop])
    last = generate(make_engine(tiny_llama), {"x": PROMPT}, at_max)["x"]
    assert (last.finish_reason, last.text, last.token_ids) == ("stop", out.text, out.token_ids)


def test_stop_token_ids_max_tokens_and_eos(tiny_llama):
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = generate(make_engine(tiny_llama), {"x": PROMPT}, greedy)["x"].token_ids
    stop_id = ref[4]
    out = generate(
        make_engine(tiny_llama), {"x": PROMPT}, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id])
    )["x"]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[: ref.index(stop_id) + 1]
    out = generate(make_engine(tiny_llama), {"x": PROMPT}, SamplingParams(max_tokens=3, temperature=0))["x"]
    assert out.finish_reason == "length" and out.token_ids == ref[:3]
    # EOS ends a request unless ignore_eos is set.
    engine = make_engine(tiny_llama)
    engine.scheduler.eos_token_ids = frozenset({stop_id})
    out = generate(engine, {"x": PROMPT}, SamplingParams(max_tokens=20, temperature=0))["x"]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_id
    engine = make_engine(tiny_llama)
    engine.scheduler.eos_token_ids = frozenset({stop_id})
    assert generate(engine, {"x": PROMPT}, greedy)["x"].token_ids == ref


def test_generation_stops_at_max_model_len(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=len(PROMPT) + 5)
    out = generate(engine, {"x": PROMPT}, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))["x"]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_a_migrated_request_continues_exactly(tiny_llama):
    """Recomputing prompt + the tokens generated so far (what a migration does) continues with the
    same tokens, greedy or seeded, and streams only the new text."""
    for params in (
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True),
    ):
        full = generate(make_engine(tiny_llama), {"x": PROMPT}, params)["x"]
        engine = make_engine(tiny_llama)
        engine.add_request("x", PROMPT, params, output_token_ids=full.token_ids[:6])
        rest = run_to_completion(engine)["x"]
        assert rest.token_ids == full.token_ids
    with pytest.raises(ValueError, match="already reach max_tokens"):
        make_engine(tiny_llama).add_request("y", PROMPT, SamplingParams(max_tokens=3), output_token_ids=[1, 2, 3])
