"""A GGUF file's own Q4_0, Q4_1 and Q8_0 blocks as --quantization's codes (engine/gguf_blocks.py):
each block type decoded as gguf-py dequantizes it; the embedded model's Q4_1 linears kept at
conversion and run as they are (int4 and int8 give the same bits, and in fp32 the logits of
transformers' own dequantized model); a wrong row order refused by the check."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine import cpu_kernels, gguf_blocks
from engine.linear import dequantize_groups

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the quantized kernel is one of the C++ CPU kernels")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_each_block_type_decodes_to_the_weights_gguf_py_dequantizes(kind):
    qtype = GGMLQuantizationType[kind]
    weight = np.random.default_rng(5).standard_normal((24, 96)).astype(np.float32) * 0.05
    raw = quantize(weight, qtype)  # [24, 3 blocks x their bytes]
    codes, scales, zeros = gguf_blocks.decode(kind, raw)
    assert codes.shape == (24, 96) and scales.shape == zeros.shape == (24, 3)
    assert int(codes.max()) < 2 ** gguf_blocks.CODE_BITS[kind]
    want = torch.from_numpy(dequantize(raw, qtype))
    torch.testing.assert_close(dequantize_groups(codes, scales, zeros), want, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def embedded():
    from engine.model_source import embedded_gguf_path, resolve_model

    return embedded_gguf_path("smollm2-135m"), resolve_model("smollm2-135m")


@pytest.mark.slow
def test_the_embedded_model_runs_int4_and_int8_on_its_own_q4_1_blocks(embedded):
    """Every decoder linear (30 layers x 7) kept as its Q4_1 blocks; int4 and int8 hold the same
    codes, so their logits are the same bits; in fp32 they are those of transformers' model dequantized
    from the file."""
    from test_quantization import next_logits
    from transformers import AutoModelForCausalLM

    from engine import EngineConfig, LLMEngine

    gguf, model_dir = embedded
    blocks = gguf_blocks.load(model_dir, 4)
    assert len(blocks) == 30 * 7 and {b[3] for b in blocks.values()} == {"Q4_1"}
    assert gguf_blocks.load(model_dir)["model.embed_tokens.weight"][3] == "Q8_0"  # the tied head's
    engines = {
        q: LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", kv_cache_bytes=64 << 20, quantization=q))
        for q in ("int4", "int8")
    }
    assert engines["int4"].numerics == "default; int4 weights from GGUF Q4_1/Q8_0 blocks"
    # transformers dequantizes the file itself in fp32: the file's weights (the converted directory
    # holds them rounded to bf16); the engine looks tokens up in that copy of the Q8_0 embedding
    # and runs its LM head on the Q8_0 blocks
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    head = hf.get_input_embeddings().weight.detach().clone()
    hf.get_input_embeddings().weight.data = head.bfloat16().float()
    hf.lm_head.weight = torch.nn.Parameter(head)  # untied: the file's head
    tok = engines["int4"].tokenizer
    for text in ("The capital of France is", "def fibonacci(n):"):
        prompt = tok.encode(text)
        got = {q: next_logits(e, prompt) for q, e in engines.items()}
        assert torch.equal(got["int4"], got["int8"])
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        ref, out = ref.log_softmax(-1), got["int4"].log_softmax(-1)
        kl = float((ref.exp() * (ref - out)).sum())
        assert kl < 1e-6, kl  # the file's weights, not a copy quantized again


@pytest.mark.slow
def test_blocks_in_another_row_order_are_refused_and_quantized_again(embedded, tmp_path, monkeypatch, caplog):
    """The check at conversion is what keeps a wrong layout out: without the inverse of llama.cpp's
    q and k row permutation, those blocks fail it and only the other five linears a layer (and the head) are kept."""
    gguf, model_dir = embedded
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(model_dir / name)
    monkeypatch.setattr(gguf_blocks, "unpermute", lambda t, heads: t)
    with caplog.at_level(logging.WARNING, logger="engine.gguf_blocks"):
        assert gguf_blocks.save(gguf, tmp_path) == 30 * 5 + 1
    assert "self_attn.q_proj.weight's Q4_1 blocks do not give back the converted tensor" in caplog.text
    kept = gguf_blocks.load(tmp_path, 8)
    assert not any(".q_proj." in n or ".k_proj." in n for n in kept) and len(kept) == 151
    assert oct((tmp_path / gguf_blocks.BLOCKS_FILE).parent.stat().st_mode & 0o777) == "0o700"


@pytest.mark.slow
def test_in_bf16_pairs_the_files_blocks_give_the_bf16_checkpoints_logits(embedded):
    """bf16 on a CPU with AVX512_BF16, where the default's linears are the ordered kernel: each
    weight the quantized kernel rounds to bf16 is the converted checkpoint's, summed in the same
    order, so int4's logits are the default's bit for bit (its KL against fp32 is bf16's own)."""
    from test_quantization import next_logits

    from engine import EngineConfig, LLMEngine

    if "-mavx512bf16" not in cpu_kernels.BUILT[0]:
        pytest.skip("the quantized kernel multiplies bf16 pairs only where the CPU has AVX512_BF16")
    engines = {
        q: LLMEngine(EngineConfig(model="smollm2-135m", dtype="bfloat16", kv_cache_bytes=64 << 20, quantization=q))
        for q in ("none", "int4")
    }
    if engines["none"].runner.linear_kernel != "ordered":
        pytest.skip("the default's linears are oneDNN's here, which sum in another order")
    tok = engines["none"].tokenizer
    for text in ("The capital of France is", "def fibonacci(n):"):
        got = [next_logits(e, tok.encode(text)) for e in engines.values()]
        assert torch.equal(got[0], got[1])


@pytest.mark.slow
def test_the_pd_split_runs_the_files_blocks_in_both_pools(embedded):
    """Both pools int4 on the embedded model's Q4_1 blocks (bf16, the default dtype here): the
    numerics tags agree, the KV crosses, and each answer is what one such engine gives alone."""
    from cluster import engine_config, split_results

    from engine import LLMEngine, SamplingParams

    pool = {"dtype": "bfloat16", "quantization": "int4"}
    alone = LLMEngine(engine_config("smollm2-135m", **pool))
    assert alone.numerics.endswith("int4 weights from GGUF Q4_1/Q8_0 blocks"), alone.numerics
    prompts = [alone.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    cases = [(p, SamplingParams(max_tokens=12, temperature=t, seed=4)) for p in prompts for t in (0, 1.0)]
    results = split_results("smollm2-135m", cases, prefill_engine=pool, decode_engine=pool)
    for i, ((prompt, params), result) in enumerate(zip(cases, results)):
        alone.add_request(str(i), prompt, params)
        while alone.has_unfinished():
            done = [o for o in alone.step() if o.finished]
        assert result.token_ids == done[0].token_ids, i
