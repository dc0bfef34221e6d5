"""Our forward against transformers' on tiny random checkpoints, in fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM

from engine.attention import build_metadata
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

ATOL = 1e-4
PROMPTS = [[5, 17, 33, 8, 90, 41, 7], [200, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [64]]

ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
}


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def check_prefill_then_decode(
    model_dir, steps: int = 6, cpu_kernels: bool = True, linear_kernel: str = "auto", prompts=PROMPTS, **engine
):
    """A prefill of mixed-length prompts in one forward, then decode steps of the mixed batch, with
    a new prompt joining mid-way so one step mixes decode and prefill."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = make_engine(model_dir, cpu_kernels=cpu_kernels, linear_kernel=linear_kernel, **engine)
    assert engine.runner.use_cpu_kernels == cpu_kernels
    runner, bm = engine.runner, engine.block_manager
    seqs = [Sequence(f"r{i}", list(p), SamplingParams(temperature=0)) for i, p in enumerate(prompts[:3])]
    late = Sequence("late", list(prompts[2][:-4]), SamplingParams(temperature=0))
    for step in range(steps):
        if step == 2:
            seqs.append(late)
        counts = [s.num_tokens - s.num_computed_tokens for s in seqs]
        for s, n in zip(seqs, counts):
            bm.allocate(s, s.num_computed_tokens + n)
        rows, _, logits = runner.forward(ScheduledBatch(seqs, counts))
        assert rows == list(range(len(seqs)))
        for s, row in zip(seqs, logits):
            ref = hf_last_logits(hf, s.prompt_token_ids + s.output_token_ids)
            torch.testing.assert_close(row, ref, atol=ATOL, rtol=0)
        for s, n, row in zip(seqs, counts, logits):
            s.num_computed_tokens += n
            s.output_token_ids.append(int(row.argmax()))


@pytest.mark.parametrize(
    "cpu_kernels, linear_kernel",
    [(True, "auto"), (True, "ordered"), (True, "onednn"), (False, "auto")],
    ids=["cpu-kernels", "ordered-linears", "onednn-linears", "plain-torch"],
)
def test_llama_prefill_and_decode_match_transformers(tiny_llama, cpu_kernels, linear_kernel):
    check_prefill_then_decode(tiny_llama, cpu_kernels=cpu_kernels, linear_kernel=linear_kernel)


def test_the_linear_kernel_is_the_one_asked_for_and_a_wrong_one_is_named(tiny_llama):
    ordered = make_engine(tiny_llama, linear_kernel="ordered").runner.model.w.layers[0].qkv
    onednn = make_engine(tiny_llama, linear_kernel="onednn").runner.model.w.layers[0].qkv
    chunks = make_engine(tiny_llama, linear_kernel="onednn_chunks").runner.model.w.layers[0].qkv
    assert ordered.panels is not None and onednn.panels is None and not onednn.chunk_rows
    assert chunks.panels is None and chunks.chunk_rows == 32
    with pytest.raises(ValueError, match=r"linear_kernel ordered: needs the C\+\+ CPU kernels.*cpu_kernels False"):
        make_engine(tiny_llama, linear_kernel="ordered", cpu_kernels=False)
    choices = r"\('auto', 'ordered', 'onednn', 'onednn_chunks'\)"
    with pytest.raises(ValueError, match=rf"linear_kernel must be one of {choices}, got 'mkl'"):
        make_engine(tiny_llama, linear_kernel="mkl")


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "plain-torch"])
def test_qwen2_with_qkv_bias_matches_transformers(tiny_qwen2, cpu_kernels):
    check_prefill_then_decode(tiny_qwen2, cpu_kernels=cpu_kernels)


def test_tied_embeddings_match_transformers(tmp_path):
    check_prefill_then_decode(make_tiny_model(tmp_path, "llama", seed=3, tie=True), steps=3)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "plain-torch"])
def test_mistral_sliding_window_matches_transformers(tmp_path, cpu_kernels):
    # A window of 5 tokens, shorter than the prompts, so the window really cuts attention.
    model = make_tiny_model(tmp_path, "mistral", seed=5, sliding_window=5)
    check_prefill_then_decode(model, cpu_kernels=cpu_kernels)


def test_bf16_kernels_agree_with_plain_torch(tiny_llama):
    """In bf16 the fused kernels round differently from the op-by-op torch path; the two must still
    give nearly the same distributions, and the same greedy tokens up to a tie within rounding."""
    from conftest import run_to_completion

    results = {}
    for cpu_kernels in (True, False):
        engine = make_engine(tiny_llama, dtype="bfloat16", cpu_kernels=cpu_kernels)
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5))
        results[cpu_kernels] = run_to_completion(engine)
    for i in range(len(PROMPTS)):
        fused, plain = results[True][str(i)], results[False][str(i)]
        for step, (a, b) in enumerate(zip(fused.logprobs, plain.logprobs)):
            for t in set(a) & set(b):
                assert abs(a[t] - b[t]) < 0.05
            x, y = fused.token_ids[step], plain.token_ids[step]
            if x != y:
                # Greedy may part only at a tie within bf16's rounding (vLLM's check_logprobs_close):
                # each side's token is the other's runner-up by under 0.05. The rest then differs.
                assert x in b and y in a and abs(a[x] - a[y]) < 0.05 and abs(b[x] - b[y]) < 0.05, (i, step)
                break


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_variants_match_transformers(tmp_path, variant):
    check_prefill_then_decode(
        make_tiny_model(tmp_path, "llama", seed=4, rope_parameters=ROPE_VARIANTS[variant]), steps=3
    )


def test_prefill_logits_at_every_position(tiny_llama):
    """The packed prefill (no padding between prompts) is right at every position, not only the last."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    engine = make_engine(tiny_llama)
    seqs = [Sequence(f"r{i}", p, SamplingParams()) for i, p in enumerate(PROMPTS)]
    for s in seqs:
        engine.block_manager.allocate(s, s.num_tokens)
    lens = [s.num_tokens for s in seqs]
    meta = build_metadata(
        [0] * len(seqs), lens, [s.block_table for s in seqs], 0, engine.config.block_size, None, engine.device
    )
    ids = torch.tensor([t for p in PROMPTS for t in p])
    logits = engine.runner.model.compute_logits(engine.runner.model.forward(ids, meta.positions, meta, engine.kv_cache))
    start = 0
    for p in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits[start : start + len(p)], ref, atol=ATOL, rtol=0)
        start += len(p)


def test_greedy_generate_equals_transformers_generate(tiny_qwen2):
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    engine = make_engine(tiny_qwen2)
    from conftest import run_to_completion

    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine)
    for i, p in enumerate(PROMPTS):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=hf.config.vocab_size, pad_token_id=0
        )
        assert outs[str(i)].token_ids == ref[0, len(p) :].tolist()
