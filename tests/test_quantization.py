"""Weight-only int8 (--quantization int8): the kernel's rows bit-equal alone and at every batch
position, equal to its definition; the engine's logits close to transformers' fp32 (KL, greedy
agreement); deterministic mode with it; the P/D split with both pools int8, and pools that differ
refused by name; what `pdserve plan memory` counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cluster import split_results
from conftest import make_engine
from test_model_equality import PROMPTS, hf_last_logits
from transformers import AutoModelForCausalLM

from engine import SamplingParams, cpu_kernels
from engine.linear import quantize_int8
from engine.sequence import Sequence

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the int8 kernel is one of the C++ CPU kernels")


def int8_linear(x, weight, bias=None):
    panels, scales = torch.ops.pdserve.int8_linear_pack(*quantize_int8(weight), x.dtype)
    return torch.ops.pdserve.int8_linear(x.contiguous(), panels, scales, bias, weight.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(48, 40), (37, 19), (100, 64)])
def test_a_row_is_the_same_bits_alone_and_at_every_batch_position(dtype, n, k):
    g = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(20, k, generator=g).to(dtype)
    alone = [int8_linear(x[i : i + 1], weight, bias) for i in range(len(x))]
    for rows in (1, 2, 7, 8, 9, 16, 20):
        for start in (0, 20 - rows):
            batch = int8_linear(x[start : start + rows], weight, bias)
            assert all(torch.equal(batch[i], alone[start + i][0]) for i in range(rows)), (rows, start)


def test_the_kernel_equals_its_definition():
    """fp32: y = scale[n] * sum_k x[m, k] q[n, k] + b[n], against float64."""
    g = torch.Generator().manual_seed(7)
    weight, bias, x = torch.randn(70, 33, generator=g), torch.randn(70, generator=g), torch.randn(9, 33, generator=g)
    q, scale = quantize_int8(weight)
    want = (x.double() @ q.double().T) * scale.double() + bias.double()
    torch.testing.assert_close(int8_linear(x, weight, bias).double(), want, rtol=1e-5, atol=1e-5)
    assert (weight - q.float() * scale[:, None]).abs().max() <= scale.max() / 2 + 1e-6  # round to nearest


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 32, 70])
def test_a_bf16_model_s_int8_tile_is_the_bf16_tile_over_the_integers(rows):
    """bf16: with unit scales, the int8 kernel's outputs are the ordered bf16 kernel's over the same
    integers as bf16 weights, bit for bit, at one tile and at several."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (45, 38), generator=g, dtype=torch.int8)
    x = torch.randn(rows, 38, generator=g).bfloat16()
    panels, scales = torch.ops.pdserve.int8_linear_pack(q, torch.ones(45), torch.bfloat16)
    got = torch.ops.pdserve.int8_linear(x, panels, scales, None, 45)
    want = torch.ops.pdserve.ordered_linear(x, torch.ops.pdserve.ordered_linear_pack(q.bfloat16()), None, 45)
    assert torch.equal(got, want)


def next_logits(engine, prompt: list[int]) -> torch.Tensor:
    seq = Sequence("x", list(prompt), SamplingParams(temperature=0))
    engine.block_manager.allocate(seq, seq.num_tokens)
    from engine.scheduler import ScheduledBatch

    _, _, logits = engine.runner.forward(ScheduledBatch([seq], [seq.num_tokens]))
    engine.block_manager.free(seq)
    return logits[0]


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_int8_logits_are_close_to_transformers_fp32(model, request):
    """KL of the int8 engine's next-token distribution against transformers' fp32, and greedy
    agreement by vLLM's check_logprobs_close rule (a differing token is in the other's top 5)."""
    path = request.getfixturevalue(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(path, quantization="int8")
    assert engine.numerics == "default; int8 weights"
    worst = 0.0
    for prompt in PROMPTS:
        got, ref = next_logits(engine, prompt).log_softmax(-1), hf_last_logits(hf, prompt).log_softmax(-1)
        worst = max(worst, float((ref.exp() * (ref - got)).sum()))
        if got.argmax() != ref.argmax():
            assert got.argmax() in ref.topk(5).indices and ref.argmax() in got.topk(5).indices
    assert 0 < worst < 1e-3, worst


def test_int8_in_deterministic_mode_is_batch_invariant(tiny_llama):
    """Each request of a mixed batch gets the tokens it gets alone (fp32, deterministic, int8)."""
    params = [SamplingParams(max_tokens=8, temperature=t, seed=i) for i, t in enumerate([0, 1.0, 0, 1.0])]
    batch = make_engine(tiny_llama, quantization="int8", deterministic=True)
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        batch.add_request(str(i), p, sp)
    outs = {}
    while batch.has_unfinished():
        outs |= {o.request_id: o.token_ids for o in batch.step() if o.finished}
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        alone = make_engine(tiny_llama, quantization="int8", deterministic=True)
        alone.add_request("a", p, sp)
        while alone.has_unfinished():
            done = [o for o in alone.step() if o.finished]
        assert done[0].token_ids == outs[str(i)], i


def test_the_pd_split_with_both_pools_int8_gives_the_engines_tokens(tiny_llama):
    cases = [(p, SamplingParams(max_tokens=10, temperature=t, seed=3)) for p in PROMPTS[:3] for t in (0, 1.0)]
    int8 = {"quantization": "int8"}
    results = split_results(tiny_llama, cases, prefill_engine=int8, decode_engine=int8)
    for (prompt, params), result in zip(cases, results):
        engine = make_engine(tiny_llama, quantization="int8")
        engine.add_request("a", prompt, params)
        while engine.has_unfinished():
            done = [o for o in engine.step() if o.finished]
        assert result.token_ids == done[0].token_ids


def test_pools_of_other_quantizations_refuse_each_others_kv_by_name(tiny_llama):
    import grpc

    with pytest.raises(grpc.RpcError) as err:
        split_results(tiny_llama, [(PROMPTS[0], SamplingParams(max_tokens=4))], prefill_engine={"quantization": "int8"})
    assert "numerics: decode 'default', prefill 'default; int8 weights'" in err.value.details(), err.value.details()


def test_quantization_is_refused_where_its_kernel_cannot_run(tiny_llama):
    with pytest.raises(ValueError, match="quantization int8: needs the C.. CPU kernels"):
        make_engine(tiny_llama, quantization="int8", cpu_kernels=False)
    with pytest.raises(ValueError, match=r"quantization must be one of \('none', 'int8'\), got 'int4'"):
        make_engine(tiny_llama, quantization="int4")


def test_plan_memory_counts_a_byte_a_weight_and_a_scale_a_channel():
    from engine.model_config import ModelConfig
    from pdserve.plan.memory import linear_shapes, memory

    cfg = ModelConfig.from_dir(Path(__file__).parent.parent / "deploy" / "model_configs" / "llama-3.1-8b")
    plain, int8 = memory(cfg, "bfloat16"), memory(cfg, "bfloat16", quantization="int8")
    weights, channels = linear_shapes(cfg)
    assert weights == 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    assert plain["weight_bytes"] - int8["weight_bytes"] == weights - 4 * channels
    assert json.loads(json.dumps(int8))["quantization"] == "int8"


def test_int8_with_speculation_and_the_prefix_cache_gives_its_own_tokens(tiny_llama):
    """n-gram drafts verified and cached prefixes reused, over int8 linears: the tokens of a plain
    int8 engine (fp32, greedy and seeded)."""
    prompt = PROMPTS[0] * 3  # repeats: the n-gram proposer has drafts to make
    params = [SamplingParams(max_tokens=16, temperature=t, seed=2, ignore_eos=True) for t in (0, 1.0)]

    def tokens(engine):
        out = []
        for i, p in enumerate(params * 2):  # the second pass finds the prompt cached
            engine.add_request(str(i), prompt, p)
            while engine.has_unfinished():
                done = [o for o in engine.step() if o.finished]
            out.append(done[0].token_ids)
        return out

    plain = tokens(make_engine(tiny_llama, quantization="int8", enable_prefix_caching=False))
    speculative = {"method": "ngram", "num_speculative_tokens": 3}
    engine = make_engine(tiny_llama, quantization="int8", speculative=speculative)
    assert tokens(engine) == plain
    assert engine.num_accepted_tokens > 0 and engine.block_manager.num_hit_tokens > 0  # both features happened


@pytest.mark.parametrize("op", ["ordered", "int8"])
def test_an_out_features_the_panels_do_not_hold_is_refused(op):
    """The ops write out_features columns of y from the panels: more (past the panels' memory) or
    fewer (past y's row) than the panels were packed for is refused, never computed."""
    weight, x = torch.randn(40, 16), torch.randn(3, 16)
    if op == "int8":
        packed = torch.ops.pdserve.int8_linear_pack(*quantize_int8(weight), x.dtype)
        call = lambda n: torch.ops.pdserve.int8_linear(x, *packed, None, n)  # noqa: E731
    else:
        panels = torch.ops.pdserve.ordered_linear_pack(weight)
        call = lambda n: torch.ops.pdserve.ordered_linear(x, panels, None, n)  # noqa: E731
    assert call(40).shape == (3, 40)
    for n in (1, 8, 200, -1):
        with pytest.raises(RuntimeError, match="must come from"):
            call(n)
