"""Weight-only int8 and int4 (--quantization), groups of 32: the kernel's rows bit-equal alone and
at every batch position, equal to its definition and to the ordered kernel over its weights; a
GGUF Q4_1 block held exactly; the engine's logits close to transformers' fp32 (KL, greedy
agreement); deterministic mode, speculation and the prefix cache with it; the P/D split with both
pools int8, and pools that differ refused by name; what `pdserve plan memory` counts."""

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
from engine.linear import GROUP, dequantize_groups, quantize_groups
from engine.sequence import Sequence

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the quantized kernel is one of the C++ CPU kernels")


def quant_linear(x, weight, bits, bias=None):
    packed = torch.ops.pdserve.quant_linear_pack(*quantize_groups(weight, bits), bits, x.dtype)
    return torch.ops.pdserve.quant_linear(x.contiguous(), *packed, bias, bits, weight.shape[0])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(48, 40), (37, 19), (100, 64), (33, 97)])
def test_a_row_is_the_same_bits_alone_and_at_every_batch_position(bits, dtype, n, k):
    g = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(20, k, generator=g).to(dtype)
    alone = [quant_linear(x[i : i + 1], weight, bits, bias) for i in range(len(x))]
    for rows in (1, 2, 7, 8, 9, 16, 20):
        for start in (0, 20 - rows):
            batch = quant_linear(x[start : start + rows], weight, bits, bias)
            assert all(torch.equal(batch[i], alone[start + i][0]) for i in range(rows)), (rows, start)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_kernel_equals_its_definition(bits):
    """fp32: y = sum_k x[m, k] (code[n, k] scale[n, g] + zero[n, g]) + b[n], against float64; each
    weight within half a scale of the checkpoint's (K not a whole number of groups)."""
    g = torch.Generator().manual_seed(7)
    weight, bias, x = torch.randn(70, 83, generator=g), torch.randn(70, generator=g), torch.randn(9, 83, generator=g)
    codes, scales, zeros = quantize_groups(weight, bits)
    assert int(codes.max()) <= 2**bits - 1 and scales.shape == (70, 3)
    w = dequantize_groups(codes, scales, zeros)
    want = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(quant_linear(x, weight, bits, bias).double(), want, rtol=1e-5, atol=1e-5)
    half_scale = scales.repeat_interleave(GROUP, dim=1)[:, :83] / 2
    assert ((weight - w).abs() <= half_scale * (1 + 1e-5)).all()  # round to nearest


def test_int4_holds_a_gguf_q4_1_block_exactly():
    """Weights that were Q4_1 blocks (m + d q, q in 0..15, as the embedded model's were before it was
    dequantized) come back as the same 16 levels a block: int4's groups are GGUF's blocks."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (64, 96), generator=g)
    q[:, ::GROUP], q[:, 1::GROUP] = 0, 15  # each block spans its levels, as llama.cpp's quantizer makes it
    d, m = torch.rand(64, 3, generator=g) * 0.01 + 1e-3, torch.randn(64, 3, generator=g) * 0.02
    weight = (q * d.repeat_interleave(GROUP, 1) + m.repeat_interleave(GROUP, 1)).float()
    codes, scales, zeros = quantize_groups(weight, 4)
    assert torch.equal(codes.long(), q)
    torch.testing.assert_close(dequantize_groups(codes, scales, zeros), weight, rtol=0, atol=1e-7)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 32, 70])
@pytest.mark.parametrize("k", [30, 83, 97])
def test_a_bf16_model_s_quantized_tile_is_the_ordered_tile_over_its_weights(bits, rows, k):
    """bf16 x: the quantized kernel's outputs are the ordered kernel's over the weights its codes
    stand for (code * scale + zero in fp32, each group its own), bit for bit, at one tile and at
    several, one group and several with a short last one: in bf16 pairs where the build has
    AVX512_BF16 (each weight rounded to bf16), else in fp32 over x widened."""
    g = torch.Generator().manual_seed(rows * k)
    weight, x = torch.randn(45, k, generator=g), torch.randn(rows, k, generator=g).bfloat16()
    codes, scales, zeros = quantize_groups(weight, bits)
    scales, zeros = (t.repeat_interleave(GROUP, dim=1)[:, :k] for t in (scales, zeros))
    if "-mfma" in cpu_kernels.BUILT[0]:  # the kernel's multiply-add is fused: exact in double, then one rounding
        w = (codes.double() * scales.double() + zeros.double()).float()
    else:  # plain C++: a multiply, then an add
        w = codes.float() * scales + zeros
    got = quant_linear(x, weight, bits)
    pack, linear = torch.ops.pdserve.ordered_linear_pack, torch.ops.pdserve.ordered_linear
    if "-mavx512bf16" in cpu_kernels.BUILT[0]:
        want = linear(x, pack(w.bfloat16()), None, 45)
    else:
        want = linear(x.float(), pack(w), None, 45).bfloat16()
    assert torch.equal(got, want)


def next_logits(engine, prompt: list[int]) -> torch.Tensor:
    seq = Sequence("x", list(prompt), SamplingParams(temperature=0))
    engine.block_manager.allocate(seq, seq.num_tokens)
    from engine.scheduler import ScheduledBatch

    _, _, logits = engine.runner.forward(ScheduledBatch([seq], [seq.num_tokens]))
    engine.block_manager.free(seq)
    return logits[0]


@pytest.mark.parametrize("quantization, bound", [("int8", 1e-3), ("int4", 0.1)])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_quantized_logits_are_close_to_transformers_fp32(model, request, quantization, bound):
    """KL of the int8 engine's next-token distribution against transformers' fp32, and greedy
    agreement by vLLM's check_logprobs_close rule (a differing token is in the other's top 5)."""
    path = request.getfixturevalue(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(path, quantization=quantization)
    assert engine.numerics == f"default; {quantization} weights"
    worst = 0.0
    for prompt in PROMPTS:
        got, ref = next_logits(engine, prompt).log_softmax(-1), hf_last_logits(hf, prompt).log_softmax(-1)
        worst = max(worst, float((ref.exp() * (ref - got)).sum()))
        if quantization == "int8" and got.argmax() != ref.argmax():  # int4 moves a random model's flat top 5
            assert got.argmax() in ref.topk(5).indices and ref.argmax() in got.topk(5).indices
    assert 0 < worst < bound, worst


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_deterministic_mode_is_batch_invariant(tiny_llama, quantization):
    """Each request of a mixed batch gets the tokens it gets alone (fp32, deterministic, quantized)."""
    params = [SamplingParams(max_tokens=8, temperature=t, seed=i) for i, t in enumerate([0, 1.0, 0, 1.0])]
    batch = make_engine(tiny_llama, quantization=quantization, deterministic=True)
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        batch.add_request(str(i), p, sp)
    outs = {}
    while batch.has_unfinished():
        outs |= {o.request_id: o.token_ids for o in batch.step() if o.finished}
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        alone = make_engine(tiny_llama, quantization=quantization, deterministic=True)
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
    with pytest.raises(ValueError, match=r"quantization must be one of \('none', 'int8', 'int4'\), got 'int3'"):
        make_engine(tiny_llama, quantization="int3")


def test_plan_memory_counts_the_codes_and_a_scale_and_zero_a_group():
    from engine.model_config import ModelConfig
    from pdserve.plan.memory import memory

    cfg = ModelConfig.from_dir(Path(__file__).parent.parent / "deploy" / "model_configs" / "llama-3.1-8b")
    plain = memory(cfg, "bfloat16")
    weights = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)  # every K a multiple of 32
    for quantization, code_bytes in (("int8", 1), ("int4", 0.5)):
        plan = memory(cfg, "bfloat16", quantization=quantization)
        assert plain["weight_bytes"] - plan["weight_bytes"] == weights * (2 - code_bytes) - 8 * weights // 32
        assert json.loads(json.dumps(plan))["quantization"] == quantization


def linears(obj) -> list:
    """Every Linear under the engine's weights (dataclasses and lists of them)."""
    import dataclasses

    from engine.linear import Linear

    if isinstance(obj, Linear):
        return [obj]
    if isinstance(obj, list):
        return [lin for item in obj for lin in linears(item)]
    if dataclasses.is_dataclass(obj):
        return [lin for f in dataclasses.fields(obj) for lin in linears(getattr(obj, f.name))]
    return []


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_moe_model_keeps_its_routers_and_plan_memory_counts_what_the_engine_quantized(tmp_path, quantization):
    """Qwen2-MoE with a shared expert and a dense layer: the routers and the shared-expert gate stay
    in the model dtype (they choose experts), every other decoder linear is codes, and `pdserve plan
    memory`'s count is the engine's; the logits stay close to transformers' fp32."""
    from tiny_models import make_tiny_model

    from engine.model_config import ModelConfig
    from pdserve.plan.memory import quantized_bytes

    path = make_tiny_model(tmp_path / "moe", "qwen2_moe", seed=26, mlp_only_layers=[0])
    engine = make_engine(path, quantization=quantization)
    w = engine.runner.model.w
    gates = [lin for layer in w.layers if layer.moe for lin in (layer.moe.router, layer.moe.shared_gate)]
    assert gates and all(lin.bits is None for lin in gates)
    quantized = [lin for layer in w.layers for lin in linears(layer) if lin.bits]
    assert len(quantized) == len(linears(w.layers)) - len(gates) and w.lm_head.bits is None
    weights, _ = quantized_bytes(ModelConfig.from_dir(path), quantization)
    assert sum(lin.out_features * lin.in_features for lin in quantized) == weights
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        got, ref = next_logits(engine, prompt).log_softmax(-1), hf_last_logits(hf, prompt).log_softmax(-1)
        assert float((ref.exp() * (ref - got)).sum()) < (1e-3 if quantization == "int8" else 0.1)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_speculation_and_prefix_cache_give_their_own_tokens(tiny_llama, quantization):
    """n-gram drafts verified and cached prefixes reused, over quantized linears: the tokens of a
    plain engine of that quantization (fp32, greedy and seeded)."""
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

    plain = tokens(make_engine(tiny_llama, quantization=quantization, enable_prefix_caching=False))
    speculative = {"method": "ngram", "num_speculative_tokens": 3}
    engine = make_engine(tiny_llama, quantization=quantization, speculative=speculative)
    assert tokens(engine) == plain
    assert engine.num_accepted_tokens > 0 and engine.block_manager.num_hit_tokens > 0  # both features happened


@pytest.mark.parametrize("op", ["ordered", "int8", "int4"])
def test_an_out_features_the_panels_do_not_hold_is_refused(op):
    """The ops write out_features columns of y from the panels: more (past the panels' memory) or
    fewer (past y's row) than the panels were packed for is refused, never computed."""
    weight, x = torch.randn(40, 16), torch.randn(3, 16)
    if op == "ordered":
        panels = torch.ops.pdserve.ordered_linear_pack(weight)
        call = lambda n: torch.ops.pdserve.ordered_linear(x, panels, None, n)  # noqa: E731
    else:
        bits = 8 if op == "int8" else 4
        packed = torch.ops.pdserve.quant_linear_pack(*quantize_groups(weight, bits), bits, x.dtype)
        call = lambda n: torch.ops.pdserve.quant_linear(x, *packed, None, bits, n)  # noqa: E731
        with pytest.raises(RuntimeError, match="must come from"):
            torch.ops.pdserve.quant_linear(x, *packed, None, 12 - bits, 40)  # the other code size
    assert call(40).shape == (3, 40)
    for n in (1, 8, 200, -1):
        with pytest.raises(RuntimeError, match="must come from"):
            call(n)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_an_input_of_another_dtype_or_a_weight_not_finite_is_refused_by_name(quantization):
    """The panels were laid out for the model dtype: an fp32 input to a bf16 linear is refused, not
    read as the wrong bits; a NaN or inf weight is refused at load, before it spreads over its group."""
    from engine.linear import Linear

    lin = Linear(torch.randn(40, 64).bfloat16(), None, "ordered", quantization)
    with pytest.raises(ValueError, match="input in torch.float32, the weight was packed for torch.bfloat16"):
        lin(torch.randn(2, 64))
    assert lin(torch.randn(2, 64).bfloat16()).shape == (2, 40)
    if quantization != "none":
        weight = torch.randn(40, 64)
        weight[3, 5] = float("nan")
        with pytest.raises(ValueError, match=r"shape \(40, 64\) holds NaN or inf"):
            Linear(weight, None, quantization=quantization)
