"""Structured output (engine/structured_output.py): a JSON schema, any JSON object, a regex, a
choice and a Lark grammar, on a random model that left alone writes none of them. Every output
that ends by the model's EOS is in its grammar (jsonschema validates the JSON); one cut by
max_tokens ends with `length`. Each request equals itself alone in a batch, under speculation
(drafts the grammar refuses are rejected) and through the P/D split (fp32)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from cluster import split_results
from conftest import make_engine
from test_model_equality import PROMPTS

from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "size", "name", "n"],
    "additionalProperties": False,
}
REGEX = "[a-z]{2,4}-[0-9]{2}"
CHOICES = ["yes", "no", "perhaps not"]
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'
KINDS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "json_object": StructuredOutput("json_object"),
    "regex": StructuredOutput("regex", REGEX),
    "choice": StructuredOutput("choice", json.dumps(CHOICES)),
    "grammar": StructuredOutput("grammar", GRAMMAR),
}


def valid(kind: str, text: str) -> bool:
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        try:
            jsonschema.validate(value, SCHEMA)
        except jsonschema.ValidationError:
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", text) is not None


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}  # by request id; sample i > 0 of n by "id/i"
    while engine.has_unfinished():
        done |= {o.request_id + (f"/{o.index}" if o.index else ""): o for o in engine.step() if o.finished}
    return done


def requests_of(kinds, **params) -> dict:
    return {
        f"{kind}-{i}-{t}": (
            prompt,
            SamplingParams(max_tokens=48, temperature=t, seed=i, structured_output=KINDS[kind], **params),
        )
        for kind in kinds
        for i, prompt in enumerate(PROMPTS)
        for t in (0, 1.0)
    }


def test_every_finished_output_is_in_its_grammar(tiny_llama):
    done = run(make_engine(tiny_llama), requests_of(KINDS))
    ended = {rid: o for rid, o in done.items() if o.finish_reason == "stop"}
    for rid, out in ended.items():
        assert valid(rid.split("-")[0], out.text), (rid, out.text)
    assert {o.finish_reason for o in done.values()} <= {"stop", "length"}
    # each kind finished half of its 8 requests or more (json_object's free keys may run to max_tokens)
    for kind in KINDS:
        assert sum(rid.startswith(kind) for rid in ended) >= (2 if kind == "json_object" else 4), kind


def test_the_negative_control_the_same_requests_unconstrained_are_not(tiny_llama):
    plain = {
        rid: (p, SamplingParams(max_tokens=48, temperature=s.temperature, seed=s.seed))
        for rid, (p, s) in requests_of(KINDS).items()
    }
    done = run(make_engine(tiny_llama), plain)
    assert not any(valid(rid.split("-")[0], o.text) for rid, o in done.items())


@pytest.mark.parametrize(
    "speculative",
    [None, {"method": "ngram", "num_speculative_tokens": 3}, "self"],
    ids=["plain", "ngram", "self-draft"],
)
def test_each_request_of_a_batch_equals_itself_alone(tiny_llama, speculative):
    """Constrained and plain requests, n > 1 (a matcher per sample), batched in fp32; with drafts
    (a draft model that knows no grammar: its drafts are checked against it)."""
    if speculative == "self":
        speculative = {"method": "draft_model", "draft_model": str(tiny_llama), "num_speculative_tokens": 3}
    requests = requests_of(["json_schema", "regex", "grammar"])
    requests["plain"] = (PROMPTS[0], SamplingParams(max_tokens=20, temperature=0))
    requests["n"] = (
        PROMPTS[1],
        SamplingParams(max_tokens=40, temperature=1.0, seed=9, n=3, structured_output=KINDS["json_schema"]),
    )
    engine = make_engine(tiny_llama, speculative=speculative, max_num_batched_tokens=32)
    done = run(engine, requests)
    for rid, request in requests.items():
        alone = run(make_engine(tiny_llama), {rid: request})
        assert done[rid].token_ids == alone[rid].token_ids, rid
        if rid == "n":
            assert [done[f"n/{i}"].token_ids for i in (1, 2)] == [alone[f"n/{i}"].token_ids for i in (1, 2)]
    samples = [done["n"], done["n/1"], done["n/2"]]
    assert len({tuple(s.token_ids) for s in samples}) == 3
    for sample in samples:
        assert sample.finish_reason == "length" or valid("json_schema", sample.text)
    if speculative:
        assert engine.num_accepted_tokens > 0


@pytest.mark.parametrize("transport, local_prefill", [("shm", "off"), ("tcp", "off"), ("tcp", "always")])
def test_the_pd_split_gives_the_engines_tokens(tiny_llama, transport, local_prefill):
    """The first token masked and sampled on the prefill node, the rest on the decode node, whose
    matcher starts from the tokens it is handed."""
    requests = requests_of(["json_schema", "choice", "grammar"])
    reference = run(make_engine(tiny_llama), requests)
    results = split_results(tiny_llama, list(requests.values()), kv_transport=transport, local_prefill=local_prefill)
    assert [r.token_ids for r in results] == [reference[rid].token_ids for rid in requests]


@pytest.mark.parametrize(
    "so, message",
    [
        (StructuredOutput("json_schema", '{"type": "integer", "minimum": 5, "maximum": 3}'), "Unsatisfiable schema"),
        (StructuredOutput("json_schema", '{"type": "objectx"}'), "Invalid type: objectx"),
        (StructuredOutput("json_schema", "{not json"), "the json_schema is not valid JSON"),
        (StructuredOutput("regex", "(x"), "the regex is invalid: .*unclosed group"),
        (StructuredOutput("grammar", "start: foo"), 'the grammar is invalid: .*unknown name: "foo"'),
        (StructuredOutput("choice", "[]"), "choice must be a non-empty list of non-empty strings"),
    ],
)
def test_bad_grammars_are_refused_naming_the_field_before_any_work(tiny_llama, so, message):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match=f"^structured_output: .*{message}"):
        engine.add_request("r", PROMPTS[0], SamplingParams(structured_output=so))
    assert not engine.has_unfinished()


def test_combinations_that_could_leave_no_token_are_refused():
    so = KINDS["regex"]
    with pytest.raises(ValueError, match="structured_output takes no ignore_eos, min_tokens or bad_words"):
        SamplingParams(structured_output=so, ignore_eos=True)
    with pytest.raises(ValueError, match=r"structured_output.kind must be one of \('json_object'"):
        StructuredOutput("xml", "<a/>")


def test_a_migrated_request_must_bring_tokens_in_its_grammar(tiny_llama):
    """A decode node handed output tokens (a migration) checks them against the grammar."""
    engine = make_engine(tiny_llama)
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=20, temperature=0, structured_output=KINDS["regex"])
    with pytest.raises(ValueError, match="output_token_ids are not in the grammar"):
        engine.add_request("bad", PROMPTS[0], params, output_token_ids=tok.encode("12", add_special_tokens=False))
    engine.add_request("good", PROMPTS[0], params, output_token_ids=tok.encode("ab", add_special_tokens=False))
    good = run(engine, {})["good"]
    assert good.text.startswith("ab") and (good.finish_reason == "length" or valid("regex", good.text))


def test_logprobs_under_a_grammar_are_finite(tiny_llama):
    """Tokens the grammar masks have logprob -inf; clamped (as vLLM) so that JSON can carry them."""
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=5, structured_output=KINDS["choice"])
    out = run(make_engine(tiny_llama), {"r": (PROMPTS[0], params)})["r"]
    values = [v for entry in out.logprobs for v in entry.values()]
    assert values and all(v >= -9999.0 for v in values) and out.text in CHOICES


def test_a_failed_matcher_ends_its_request_with_error_and_no_other(tiny_llama, monkeypatch):
    """llguidance's matcher can fail mid-output (out of its parser's fuel on a pathological
    grammar): that request ends with finish_reason error, never "stop" (its output is not known to
    be in the grammar), and the batch beside it is untouched."""
    from engine import structured_output

    catch_up = structured_output.SequenceGrammar.catch_up

    def fails_at_five(self, output_token_ids):  # the one request with a grammar
        return catch_up(self, output_token_ids) and len(output_token_ids) < 5

    monkeypatch.setattr(structured_output.SequenceGrammar, "catch_up", fails_at_five)
    json_params = SamplingParams(max_tokens=40, temperature=0, structured_output=StructuredOutput("json_object"))
    plain = SamplingParams(max_tokens=12, temperature=0)
    alone = run(make_engine(tiny_llama), {"plain": (PROMPTS[1], plain)})["plain"]
    done = run(make_engine(tiny_llama), {"json": (PROMPTS[0], json_params), "plain": (PROMPTS[1], plain)})
    assert done["json"].finish_reason == "error" and len(done["json"].token_ids) == 6, done["json"]
    assert done["plain"].token_ids == alone.token_ids and done["plain"].finish_reason == "length"
