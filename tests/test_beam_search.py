"""Beam search: the hypotheses of transformers' generate(num_beams=W, do_sample=False), through
the engine, the router across the P/D split, and the OpenAI API."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from conftest import assert_no_blocks_used, make_engine

from engine import SamplingParams
from engine.structured_output import StructuredOutput

PROMPTS = ["The quick brown fox", "Paged attention stores the KV", "Hello world!"]
SETTINGS = [(4, 12, 1.0), (3, 20, 0.5), (2, 8, 2.0)]  # beam width, max tokens, length penalty


def hf_beams(hf, ids: list[int], width: int, max_tokens: int, length_penalty: float):
    """transformers' hypotheses (generated tokens, through EOS) and their scores, best first."""
    eos = hf.config.eos_token_id
    out = hf.generate(
        torch.tensor([ids]),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        pad_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
    )
    beams = [s[len(ids) :].tolist() for s in out.sequences]
    return [b[: b.index(eos) + 1] if eos in b else b for b in beams], out.sequences_scores.tolist()


def beam_outputs(engine, rid, prompt, params) -> list:
    engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.index: o for o in engine.step() if o.request_id == rid})
    return [outs[i] for i in sorted(outs)]


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_hypotheses_equal_transformers(model, request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(path)
    finished_by_eos = 0
    for prompt in PROMPTS:
        ids = engine.tokenize(prompt)
        for width, max_tokens, penalty in SETTINGS:
            want, scores = hf_beams(hf, ids, width, max_tokens, penalty)
            got = beam_outputs(
                engine,
                f"{prompt}{width}",
                ids,
                SamplingParams(max_tokens=max_tokens, beam_width=width, length_penalty=penalty),
            )
            assert [o.token_ids for o in got] == want, (prompt, width)
            for o, score in zip(got, scores):
                assert o.cumulative_logprob / len(o.token_ids) ** penalty == pytest.approx(score, abs=1e-4)
                assert o.finish_reason == ("stop" if len(o.token_ids) < max_tokens else "length")
            finished_by_eos += sum(o.finish_reason == "stop" for o in got)
    assert_no_blocks_used(engine)
    if model == "tiny_llama":
        assert finished_by_eos > 0  # the EOS path of the rule is exercised


REGEX = "[a-z]{2,5}( [a-z]{2,5}){0,2}\\."


def grammar_mask(engine, prompt_len: int, so):
    """transformers' logits processor for the same grammar: each row's tokens so far through a
    matcher of its own, the tokens it refuses at -inf, the rest renormalized (the engine's masked
    distribution)."""
    from transformers import LogitsProcessor

    from engine.structured_output import GrammarCompiler

    cfg = engine.model_config
    compiler = GrammarCompiler(engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids)

    class Mask(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for row, ids in enumerate(input_ids.tolist()):
                matcher = compiler.matcher(so)
                if not matcher.consume_tokens(ids[prompt_len:]):  # a dead beam's row
                    scores[row] = float("-inf")
                    continue
                bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
                allowed = torch.from_numpy(bits[: scores.shape[1]].astype(bool))
                scores[row, ~allowed] = float("-inf")
            return scores.log_softmax(dim=-1)

    return Mask()


def test_beams_under_a_grammar_equal_transformers_with_the_mask(tiny_llama):
    """Each beam's own matcher: the hypotheses are transformers' beam search under the same mask
    (each row's distribution renormalized over what its grammar allows), fp32; all in the grammar."""
    import re

    from transformers import AutoModelForCausalLM, LogitsProcessorList

    so = StructuredOutput("regex", REGEX)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    engine = make_engine(tiny_llama)
    ended = changed = 0
    for prompt in PROMPTS:
        ids = engine.tokenize(prompt)
        params = SamplingParams(max_tokens=24, beam_width=3, structured_output=so)
        got = beam_outputs(engine, prompt, ids, params)
        out = hf.generate(
            torch.tensor([ids]),
            num_beams=3,
            num_return_sequences=3,
            do_sample=False,
            max_new_tokens=24,
            pad_token_id=hf.config.eos_token_id,
            logits_processor=LogitsProcessorList([grammar_mask(engine, len(ids), so)]),
        )
        eos = hf.config.eos_token_id
        want = [s[len(ids) :].tolist() for s in out]
        want = [w[: w.index(eos) + 1] if eos in w else w for w in want]
        assert [o.token_ids for o in got] == want, prompt
        for o in got:
            assert o.finish_reason == "length" or re.fullmatch(REGEX, o.text), o.text
        ended += sum(o.finish_reason == "stop" for o in got)
        plain = beam_outputs(engine, prompt + "/plain", ids, SamplingParams(max_tokens=24, beam_width=3))
        changed += [o.token_ids for o in plain] != want  # the negative control: the grammar made a difference
    assert ended > 0 and changed == len(PROMPTS), (ended, changed)
    assert_no_blocks_used(engine)


def test_beams_share_steps_with_other_requests_and_abort_frees_them(tiny_llama):
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    beams = SamplingParams(max_tokens=10, beam_width=3)
    alone_beams = beam_outputs(make_engine(tiny_llama), "b", PROMPTS[0], beams)
    alone = beam_outputs(make_engine(tiny_llama), "g", PROMPTS[1], greedy)
    engine = make_engine(tiny_llama)
    engine.add_request("g", PROMPTS[1], greedy)
    engine.add_request("b", PROMPTS[0], beams)
    done = {}
    while engine.has_unfinished():
        done.update({(o.request_id, o.index): o for o in engine.step() if o.finished})
    assert [done["b", i].token_ids for i in (0, 1, 2)] == [o.token_ids for o in alone_beams]
    assert done["b", 2].last and not done["b", 0].last
    assert done["g", 0].token_ids == alone[-1].token_ids and len(done) == 4
    assert_no_blocks_used(engine)

    engine.add_request("c", PROMPTS[2], beams)
    for _ in range(3):
        engine.step()
    assert engine.abort_request("c") and not engine.has_unfinished() and not engine.beams
    assert_no_blocks_used(engine)


def test_bad_beam_settings_are_named(tiny_llama):
    with pytest.raises(ValueError, match="beam_width must be"):
        SamplingParams(beam_width=11)
    with pytest.raises(ValueError, match="n must be <= beam_width"):
        SamplingParams(beam_width=2, n=3)
    with pytest.raises(ValueError, match="stop strings are not supported with beam search"):
        SamplingParams(beam_width=2, stop=("x",))
    with pytest.raises(ValueError, match="beam search needs enable_prefix_caching"):
        make_engine(tiny_llama, enable_prefix_caching=False).add_request("x", "hi", SamplingParams(beam_width=2))


def test_beam_search_across_the_split(tiny_llama):
    """gRPC through the router: one prefill, one transfer, the decode node searches; the same
    hypotheses as the engine alone, one sample index each."""
    from cluster import local_cluster, wait_for_no_blocks

    from router.client import AsyncClient

    want = beam_outputs(make_engine(tiny_llama), "r", PROMPTS[1], SamplingParams(max_tokens=12, beam_width=3, n=3))
    so = StructuredOutput("regex", REGEX)
    held = SamplingParams(max_tokens=16, beam_width=3, n=3, structured_output=so)
    want_held = beam_outputs(make_engine(tiny_llama), "h", PROMPTS[1], held)

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                result = await client.generate(PROMPTS[1], max_tokens=12, beam_width=3, n=3)
                assert [s.token_ids for s in result.samples] == [o.token_ids for o in want]
                assert [s.text for s in result.samples] == [o.text for o in want]
                assert result.usage["completion_tokens"] == sum(len(o.token_ids) for o in want)
                wire = {"kind": so.kind, "spec": so.spec}
                result = await client.generate(PROMPTS[1], max_tokens=16, beam_width=3, n=3, structured_output=wire)
                assert [s.token_ids for s in result.samples] == [o.token_ids for o in want_held]  # each beam's grammar
            num_prompt = len(make_engine(tiny_llama).tokenize(PROMPTS[1]))
            assert prefills[0].llm.num_prompt_tokens == 2 * num_prompt  # one prefill each
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


@pytest.mark.parametrize("fails", ["every_beam", "odd_tails"])
def test_a_beam_whose_grammar_fails_is_dropped_never_returned(tiny_llama, monkeypatch, fails):
    """A beam whose matcher fails (llguidance out of fuel) has no continuation: no hypothesis
    holds it (its tokens are not known to be in the grammar). When every beam fails, the request
    ends with finish_reason error and frees its blocks; fp32."""
    from engine import structured_output

    catch_up = structured_output.SequenceGrammar.catch_up
    refused = []

    def refuses(self, history):
        if fails == "every_beam" and history or len(history) >= 3 and history[-1] % 2:
            refused.append(list(history))
            return False
        return catch_up(self, history)

    monkeypatch.setattr(structured_output.SequenceGrammar, "catch_up", refuses)
    engine = make_engine(tiny_llama)
    params = SamplingParams(max_tokens=12, beam_width=3, structured_output=StructuredOutput("json_object"))
    got = beam_outputs(engine, "r", engine.tokenize(PROMPTS[0]), params)
    assert refused, "no beam's matcher failed: the test proves nothing"
    if fails == "every_beam":
        assert [(o.finish_reason, o.token_ids) for o in got] == [("error", [])], got
    else:
        assert got and all(o.finish_reason in ("stop", "length") for o in got), got
        for o in got:  # each step's history (h[:k], k >= 3) ended even, or that beam was dropped
            assert all(t % 2 == 0 for t in o.token_ids[2:-1]), o.token_ids
    assert_no_blocks_used(engine)
