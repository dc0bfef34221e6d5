"""Conversions between the wire messages (pdserve_api) and the engine's types, shared by the
router and the nodes."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
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
    ):
        if m.HasField(name):
            kwargs[name] = getattr(m, name)
    return SamplingParams(
        top_k=m.top_k,
        stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        cache_salt=m.cache_salt,
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
    return m


def logprobs_to_proto(entry: dict[int, float] | None) -> common_pb2.TokenLogprobs:
    entry = entry or {}
    return common_pb2.TokenLogprobs(token_ids=list(entry), logprobs=list(entry.values()))


def logprobs_from_proto(m: common_pb2.TokenLogprobs) -> dict[int, float]:
    return dict(zip(m.token_ids, m.logprobs))
