"""The engine on CUDA (skipped without a GPU): same logits as transformers, same greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine, run_to_completion
from transformers import AutoModelForCausalLM

from engine import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 17, 33, 8, 90, 41, 7], [200, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


def test_greedy_on_cuda_equals_transformers(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval().cuda()
    engine = make_engine(tiny_llama, device="cuda")
    assert engine.kv_cache.kv.is_cuda and not engine.runner.use_cpu_kernels
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine)
    for i, p in enumerate(PROMPTS):
        ref = hf.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=hf.config.vocab_size,
            pad_token_id=0,
        )
        assert outs[str(i)].token_ids == ref[0, len(p) :].tolist()


def test_seeded_sampling_on_cuda_is_reproducible(tiny_llama):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = make_engine(tiny_llama, device="cuda")
        engine.add_request("x", PROMPTS[0], params)
        runs.append(run_to_completion(engine)["x"].token_ids)
    assert runs[0] == runs[1]
