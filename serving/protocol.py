"""Conversions between the wire messages (pdserve_api) and the engine's types, shared by the
router and the nodes."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from pdserve_api import common_pb2


def sampling_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the bad field (the caller answers INVALID_ARGUMENT)."""
    kwargs = {}
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "logprobs",
        "n",
        "best_of",
        "beam_width",
        "length_penalty",
        "repetition_penalty",
    ):
        if m.HasField(name):
            kwargs[name] = getattr(m, name)
    if m.bad_words:
        raise ValueError("bad_words: strings are tokenized by the router; a node takes bad_words_token_ids")
    if m.HasField("structured_output"):
        kwargs["structured_output"] = StructuredOutput(m.structured_output.kind, m.structured_output.spec)
    return SamplingParams(
        top_k=m.top_k,
        stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        cache_salt=m.cache_salt,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        logit_bias=dict(m.logit_bias),
        min_p=m.min_p,
        min_tokens=m.min_tokens,
        bad_words_token_ids=tuple(tuple(w.ids) for w in m.bad_words_token_ids),
        **kwargs,
    )


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        cache_salt=p.cache_salt,
    )
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.n != 1:
        m.n = p.n
    if p.best_of is not None:
        m.best_of = p.best_of
    if p.beam_width != 1:
        m.beam_width, m.length_penalty = p.beam_width, p.length_penalty
    if p.repetition_penalty != 1:
        m.repetition_penalty = p.repetition_penalty
    m.presence_penalty, m.frequency_penalty, m.min_p, m.min_tokens = (
        p.presence_penalty,
        p.frequency_penalty,
        p.min_p,
        p.min_tokens,
    )
    m.logit_bias.update(dict(p.logit_bias))
    m.bad_words_token_ids.extend(common_pb2.TokenIds(ids=list(w)) for w in p.bad_words_token_ids)
    if p.structured_output is not None:
        m.structured_output.kind, m.structured_output.spec = p.structured_output.kind, p.structured_output.spec
    return m


def logprobs_to_proto(entry: dict[int, float] | None) -> common_pb2.TokenLogprobs:
    entry = entry or {}
    return common_pb2.TokenLogprobs(token_ids=list(entry), logprobs=list(entry.values()))


def logprobs_from_proto(m: common_pb2.TokenLogprobs) -> dict[int, float]:
    return dict(zip(m.token_ids, m.logprobs))
