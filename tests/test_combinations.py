"""The features together (tests/combinations.py): random mixes of requests, each finished one equal
to itself run alone (fp32), nothing left holding a block. A fast fixed-seed set; the long soak is
the module's command (docs/reliability.md)."""

from __future__ import annotations

import pytest
from combinations import Reference, Report, engine_mix

ENGINE_SEEDS = range(12)


def test_random_mixes_in_one_engine_equal_each_request_alone(tiny_llama):
    report, reference = Report(), Reference()
    for seed in ENGINE_SEEDS:
        engine_mix(tiny_llama, seed, 16, report, reference)
    print(report)
    assert not report.wrong, report.wrong[:3]
    assert not report.leaked, report.leaked
    # the set exercised what it claims: every kind of request, and the engine under pressure
    assert {"greedy", "seeded", "n>1", "beam", "stop", "stop_ids", "logprobs", "follow-up", "cancel"} <= set(
        report.kinds
    )
    assert report.preemptions and report.cache_hit_tokens and report.evicted_blocks and report.spec_accepted
    assert report.prefix_waits  # prompts on one prefix arrived together
    assert report.cancelled and report.finished > report.requests // 2


CLUSTER_SEEDS = range(100, 104)


def test_random_mixes_through_a_cluster_equal_each_request_alone(tiny_llama):
    """Through the router and real transfers (shm or tcp, remote or local prefill), speculation on
    the decode nodes, a decode node stopped abruptly mid-run in some mixes."""
    import asyncio

    from combinations import cluster_mix

    report, reference = Report(), Reference()
    for seed in CLUSTER_SEEDS:
        asyncio.run(cluster_mix(tiny_llama, seed, 24, report, reference))
    print(report)
    assert not report.wrong, report.wrong[:3]
    assert not report.leaked, report.leaked
    assert report.kills and report.cancelled and report.finished > report.requests // 2
    assert report.preemptions and report.cache_hit_tokens and report.spec_accepted


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_mixes_in_one_engine_equal_each_request_alone(tiny_llama, quantization):
    """The same mixes over quantized linears (fp32 activations): n > 1, beams, preemption, the
    prefix cache and speculation, each request the tokens it gets alone at that quantization."""
    report, reference = Report(), Reference({"quantization": quantization})
    for seed in range(6):
        engine_mix(tiny_llama, seed, 16, report, reference)
    print(report)
    assert not report.wrong, report.wrong[:3]
    assert not report.leaked, report.leaked
    assert {"n>1", "beam", "cancel"} <= set(report.kinds)
    assert report.preemptions and report.cache_hit_tokens and report.spec_accepted


def test_quantized_mixes_through_a_cluster_equal_each_request_alone(tiny_llama):
    """Both pools int4 through the router, shm and tcp, a decode node stopped mid-run (seed 100)."""
    import asyncio

    from combinations import cluster_mix

    report, reference = Report(), Reference({"quantization": "int4"})
    for seed in (100, 101):
        asyncio.run(cluster_mix(tiny_llama, seed, 24, report, reference))
    print(report)
    assert not report.wrong, report.wrong[:3]
    assert not report.leaked, report.leaked
    assert report.kills and report.finished > report.requests // 2
