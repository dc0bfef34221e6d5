"""Deterministic mode (EngineConfig.deterministic, `--deterministic`): each token's logits and KV
the same bits whatever else is in the batch, how its prompt was chunked, which prefix was cached,
the P/D split (remote or local prefill, shm or tcp), a decode node killed mid-stream, speculation or
n > 1, in bf16 and in fp32. The check is tests/combinations.py's random mixes: every finished
request equals itself run alone on a fresh engine, tokens and logprobs exactly. The negative
control: the same mixes with the mode off find differences."""

from __future__ import annotations

import asyncio

import pytest
import torch
from combinations import Reference, Report, cluster_mix, engine_mix
from conftest import make_engine

from engine import EngineConfig, cpu_kernels
from engine.hardware import can_prepack
from engine.linear import Linear, rows_invariant

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="deterministic mode needs the C++ CPU kernels")

DTYPES = ("bfloat16", "float32")
ENGINE_SEEDS = range(12)  # as tests/test_combinations.py: preemption happens in some
CLUSTER_SEEDS = range(100, 104)  # every way across, two kills, n-gram drafts (combinations.cluster_mix)


@pytest.mark.parametrize("kernel", ["ordered", "onednn_chunks"])
@pytest.mark.parametrize("dtype", (*DTYPES, "float16"))
def test_a_linears_rows_are_the_same_bits_whatever_else_is_in_the_batch(dtype, kernel):
    """An odd K (the bf16 pairs' padding), N off the panel width, more rows than the kernel keeps
    in cache at once (64) and than a chunk (32), a bias; the ordered kernel on one thread or two
    (onednn_chunks' blocking may follow the thread count: the numerics tag names it)."""
    dt = getattr(torch, dtype)
    weight, bias, x = torch.randn(100, 81, dtype=dt), torch.randn(100, dtype=dt), torch.randn(150, 81, dtype=dt)
    if kernel == "onednn_chunks" and not can_prepack(dt):
        with pytest.raises(ValueError, match=f"onednn_chunks: oneDNN cannot prepack {dt}"):
            Linear(weight, bias, kernel)
        pytest.skip(f"oneDNN does not prepack {dtype} on this CPU")
    linear = Linear(weight, bias, kernel)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
    for rows in (*range(2, 18), 31, 32, 33, 70, 150):  # every tile height, 1 to 8; a chunk's edges
        for first in (0, len(x) - rows):
            assert torch.equal(linear(x[first : first + rows]), alone[first : first + rows]), (rows, first)
    assert rows_invariant(linear)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernel != "ordered" or torch.equal(linear(x), alone)
    finally:
        torch.set_num_threads(threads)
    if kernel == "ordered":
        with pytest.raises(ValueError, match="input of 80 features, the weight takes 81"):
            linear(x[:, :80])
    # and it is the linear: off a float64 reference by at most fp32's error bound for a sum of
    # K + 1 terms (K x fp32 eps x the sum of |terms|) and one rounding to the dtype
    f64 = torch.nn.functional.linear
    exact = f64(x.double(), weight.double(), bias.double())
    terms = f64(x.double().abs(), weight.double().abs(), bias.double().abs())
    bound = 82 * torch.finfo(torch.float32).eps * terms + torch.finfo(dt).eps * exact.abs()
    assert ((alone.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_where_onednn_s_rows_move_with_the_batch_its_chunks_do_not(dtype):
    """The negative control for onednn_chunks: oneDNN called on the rows as they come picks its
    kernel by the row count (on AVX512_BF16 a lone row of K = 1536 sums in another order than a
    batch's); in chunks of 32 the same rows keep their bits."""
    dt = getattr(torch, dtype)
    if not can_prepack(dt):
        pytest.skip(f"oneDNN does not prepack {dtype} on this CPU")
    gen = torch.Generator().manual_seed(1)
    moved = 0
    for n, k in ((3072, 1536), (3072, 576), (960, 576)):
        weight, x = (torch.randn(n, k, generator=gen) * 0.05).to(dt), torch.randn(300, k, generator=gen).to(dt)
        plain, chunks = Linear(weight, None, "onednn"), Linear(weight, None, "onednn_chunks")
        together, in_chunks = plain(x), chunks(x)
        for rows in (7, 64, 300):
            moved += not torch.equal(plain(x[:rows]), together[:rows])
            assert torch.equal(chunks(x[:rows]), in_chunks[:rows]), (n, k, rows)
        for i in range(0, 300, 30):  # lone rows: in bf16 a sum's other low bits often round away
            moved += not torch.equal(plain(x[i : i + 1]), together[i : i + 1])
            assert torch.equal(chunks(x[i : i + 1]), in_chunks[i : i + 1]), (n, k, i)
    if not moved:
        pytest.skip("oneDNN's rows kept their bits at every row count tried on this CPU")


@pytest.mark.parametrize("dtype", (*DTYPES, "float16"))
def test_a_linear_rounds_its_fp32_sum_once_to_the_dtype_as_torch_does(dtype):
    """K = 1, so torch computes the same sum: x w (exact in fp32 for bf16 and fp16 inputs, rounded
    once for fp32 ones) + b, rounded in fp32, then once to the dtype (nearest even; ties are common
    among 4,000 outputs); inf kept, NaN a NaN (of whatever sign and payload), in the full panel
    and in the last one's columns."""
    dt = getattr(torch, dtype)
    weight, bias, x = torch.randn(40, 1, dtype=dt), torch.randn(40, dtype=dt), torch.randn(100, 1, dtype=dt)
    x[3], x[7] = float("inf"), float("nan")
    expected = (x.float() * weight.float().T + bias.float()).to(dt)
    got = Linear(weight, bias, "ordered")(x)
    assert torch.equal(got.isnan(), expected.isnan()) and got.isnan().any()
    bits = {torch.float32: torch.int32}.get(dt, torch.int16)
    numbers = ~expected.isnan()
    assert torch.equal(got[numbers].view(bits), expected[numbers].view(bits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_mixes_in_one_deterministic_engine_equal_each_request_alone_exactly(tiny_llama, dtype):
    report, reference = Report(), Reference.deterministic(dtype)
    for seed in ENGINE_SEEDS:
        engine_mix(tiny_llama, seed, 16, report, reference)
    print(report)
    assert not report.wrong, report.wrong[:3]
    assert not report.leaked, report.leaked
    # what the mixes exercised: batches, chunked prefills (16- and 32-token budgets), cache hits,
    # preemption, speculation, n > 1, seeds, logprobs
    assert {"greedy", "seeded", "n>1", "logprobs", "follow-up"} <= set(report.kinds)
    assert report.preemptions and report.cache_hit_tokens and report.spec_accepted and report.prefix_waits


def test_onednn_chunks_mixes_equal_each_request_alone_exactly(tiny_llama):
    """The mode on oneDNN's linears in fixed chunks (what it picks on AMX), bf16: one engine's mixes
    and a cluster's with a decode node killed, each request exactly what it gives alone."""
    if not can_prepack(torch.bfloat16):
        pytest.skip("oneDNN does not prepack bf16 on this CPU")
    report = Report()
    reference = Reference({"dtype": "bfloat16", "deterministic": True, "linear_kernel": "onednn_chunks"}, 0.0)
    for seed in range(6):
        engine_mix(tiny_llama, seed, 16, report, reference)
    asyncio.run(cluster_mix(tiny_llama, 100, 24, report, reference))
    print(report)
    assert not report.wrong, report.wrong[:3]
    assert not report.leaked, report.leaked
    assert {"n>1", "beam"} <= set(report.kinds) and report.kills
    assert report.preemptions and report.cache_hit_tokens and report.spec_accepted


def test_pools_of_other_linear_kernels_refuse_each_others_kv_by_name(tiny_llama):
    import grpc
    from cluster import split_results

    from engine import SamplingParams

    if not can_prepack(torch.bfloat16):
        pytest.skip("oneDNN does not prepack bf16 on this CPU")
    mode = {"dtype": "bfloat16", "deterministic": True}
    with pytest.raises(grpc.RpcError) as err:
        split_results(
            tiny_llama,
            [([1, 2, 3], SamplingParams(max_tokens=4))],
            prefill_engine=mode | {"linear_kernel": "onednn_chunks"},
            decode_engine=mode | {"linear_kernel": "ordered"},
        )
    assert "oneDNN linears 32 rows a call" in err.value.details(), err.value.details()


def test_random_mixes_through_a_deterministic_cluster_equal_each_request_alone_exactly(tiny_llama):
    """bf16 through the router, a prefill node and two decode nodes: shm or tcp, remote or local
    prefill, speculation on the decode nodes, a decode node killed mid-run (its streams migrate)."""
    report, reference = Report(), Reference.deterministic("bfloat16")
    for seed in CLUSTER_SEEDS:
        asyncio.run(cluster_mix(tiny_llama, seed, 24, report, reference))
    print(report)
    assert not report.wrong, report.wrong[:3]
    assert not report.leaked, report.leaked
    assert report.kills and report.finished > report.requests // 2
    assert report.cache_hit_tokens and report.spec_accepted
    assert {"shm, local prefill auto", "shm, local prefill off", "tcp, local prefill off"} <= set(report.clusters)


def test_without_the_mode_the_same_mixes_find_differences(tiny_llama):
    """The negative control. Which dtype parts depends on the CPU's kernels (on an AVX2-only CPU
    fp32's logprobs move with the batch; on CPUs with native bf16, bf16's tokens), so the
    control holds when either does."""
    wrong = {}
    for dtype in DTYPES:
        report, reference = Report(), Reference({"dtype": dtype}, logprob_tolerance=0.0)
        for seed in ENGINE_SEEDS:
            engine_mix(tiny_llama, seed, 16, report, reference)
        wrong[dtype] = len(report.wrong)
    print(wrong)
    assert any(wrong.values()), wrong


def test_the_mode_refuses_a_draft_model_whose_proposals_would_move_with_the_batch():
    with pytest.raises(ValueError, match="speculative.method must be 'ngram' with deterministic"):
        EngineConfig(deterministic=True, speculative={"method": "draft_model", "draft_model": "smollm2-135m"})
    EngineConfig(deterministic=True, speculative={"method": "ngram"})


def test_the_mode_refuses_onednn_linears():
    with pytest.raises(ValueError, match="linear_kernel must be 'ordered', 'onednn_chunks' or 'auto' with determinis"):
        EngineConfig(deterministic=True, linear_kernel="onednn")


def test_the_mode_needs_the_cpu_attention_kernel_and_says_so(tiny_llama):
    with pytest.raises(ValueError, match=r"deterministic: needs the C\+\+ CPU attention kernel.*cpu_kernels False"):
        make_engine(tiny_llama, deterministic=True, cpu_kernels=False)
