"""The engine on CUDA (skipped without a GPU): same logits as transformers, same greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_engine, run_to_completion
from transformers import AutoModelForCausalLM

from engine import SamplingParams, cuda_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 17, 33, 8, 90, 41, 7], [200, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after the prompt, alone (no EOS stop)."""
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=hf.config.vocab_size, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


TRITON = pytest.mark.skipif(not cuda_kernels.available(), reason="needs Triton")


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=TRITON)], ids=["sdpa", "triton"])
def test_greedy_on_cuda_equals_transformers(tiny_llama, kernel):
    """fp32: decodes through SDPA over gathered KV, or through the Triton paged kernel."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval().cuda()
    engine = make_engine(tiny_llama, device="cuda", cuda_kernels=kernel)
    assert engine.kv_cache.kv.is_cuda and not engine.runner.use_cpu_kernels
    assert engine.runner.decode_kernel == kernel
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine)
    for i, p in enumerate(PROMPTS):
        assert outs[str(i)].token_ids == hf_greedy(hf, p, 16)


@TRITON
def test_triton_decode_kernel_gives_the_tokens_of_sdpa_with_speculation_prefix_caching_and_preemption(tiny_llama):
    """fp32 on CUDA: the engine whose decodes and speculative verifications read the KV in place
    (engine/cuda_kernels.py) gives the greedy tokens of the engine attending through SDPA over
    gathered KV, with n-gram speculation, prompts sharing a cached prefix, and a pool small enough
    to preempt."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    stem = "Hello world! Hello world! Hello world! "
    prompts = [stem + tail for tail in ["Hello", "Hello world", "0123 0123 01", "fox fox", "Hello world! Hello"]]
    runs = {}
    for kernel in (True, False):
        engine = make_engine(
            tiny_llama,
            device="cuda",
            cuda_kernels=kernel,
            num_kv_blocks=56,
            speculative={"method": "ngram", "num_speculative_tokens": 3},
        )
        assert engine.runner.decode_kernel == kernel
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        runs[kernel] = {rid: o.token_ids for rid, o in run_to_completion(engine).items()}
        assert engine.scheduler.num_preemptions > 0 and engine.num_accepted_tokens > 0
        assert engine.block_manager.num_hit_tokens > 0
    assert runs[True] == runs[False]


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=TRITON)], ids=["sdpa", "triton"])
def test_prompts_beside_decodes_go_a_share_a_step_on_cuda_and_answer_as_transformers(tiny_llama, tmp_path, kernel):
    """fp32 on CUDA, as a decode node runs (prefill_tokens_with_decodes): prompts that arrive while
    a sequence decodes are computed 5 tokens a step beside it, and every answer is transformers'
    greedy tokens for that prompt alone."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval().cuda()
    log = tmp_path / "steps.jsonl"
    engine = make_engine(
        tiny_llama, device="cuda", cuda_kernels=kernel, prefill_tokens_with_decodes=5, step_log=str(log)
    )
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2], [(j * 31) % 200 + 3 for j in range(37)]]
    engine.add_request("0", prompts[0], params)
    engine.step()
    engine.step()  # "0" decodes
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(str(i), p, params)
    outs = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert outs[str(i)].token_ids == hf_greedy(hf, p, 24), f"prompt {i}"
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    beside = [n for step in steps if step["decodes"] for n, _ in step["prefills"]]
    assert beside and max(beside) == 5 and sum(beside) >= len(prompts[2]), steps


def test_seeded_sampling_on_cuda_is_reproducible(tiny_llama):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = make_engine(tiny_llama, device="cuda")
        assert engine.runner.decode_kernel == cuda_kernels.available()  # the Triton kernel by default
        engine.add_request("x", PROMPTS[0], params)
        runs.append(run_to_completion(engine)["x"].token_ids)
    assert runs[0] == runs[1]


def test_default_model_greedy_on_cuda_equals_transformers_in_float32():
    """The embedded default model in fp32: the engine's greedy tokens, the prompts batched
    together, equal transformers' for each prompt alone."""
    from transformers import AutoTokenizer

    from engine.model_source import DEFAULT_MODEL, resolve_model

    try:
        model_dir = resolve_model(DEFAULT_MODEL)
    except ValueError as e:  # the package that carries its weights is not installed
        pytest.skip(str(e))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for text in ("Write a haiku about the sea.", "What is 12 times 7?", "Name three planets.", "Hi")
    ]
    engine = make_engine(model_dir, device="cuda", block_size=16)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().cuda()
    for i, p in enumerate(prompts):
        assert outs[str(i)].token_ids == hf_greedy(hf, p, 32), f"prompt {i}"


def test_up_pin_gpus_runs_each_node_on_a_gpu_and_answers_as_the_engine_alone(tiny_llama, tmp_path):
    """`pdserve up --device cuda --pin-gpus` (what `pdserve plan best --gpus` prints): every node
    process gets a GPU of its own through CUDA_VISIBLE_DEVICES (round robin over what is visible)
    and runs its engine there; the KV goes over TCP (a KV on a GPU offers no shared memory); the
    greedy tokens equal the engine alone on the GPU, in fp32."""
    import json
    import signal
    import subprocess
    import sys
    import threading

    import psutil

    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--port", "0", "--dtype", "float32", "--device", "cuda"]
        + ["--pin-gpus", "--prefill", "1", "--decode", "2", "--model", str(tiny_llama), "--log-dir", str(tmp_path)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = None
        for line in up.stderr:
            if line.startswith("pdserve up: router on "):
                address = line.split()[4]
                break
        assert address, "pdserve up did not come up"
        threading.Thread(target=up.stderr.read, daemon=True).start()
        children = psutil.Process(up.pid).children()  # the node processes
        gpus = [str(i) for i in range(torch.cuda.device_count())]
        assert sorted(c.environ()["CUDA_VISIBLE_DEVICES"] for c in children) == sorted(
            gpus[i % len(gpus)] for i in range(3)
        )
        out = subprocess.run(
            [sys.executable, "-m", "pdserve", "generate", "--addr", address, "--json", "--raw"]
            + ["--max-tokens", "8", "--temperature", "0", "Hello world"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        engine = make_engine(tiny_llama, device="cuda")
        engine.add_request("x", "Hello world", SamplingParams(max_tokens=8, temperature=0))
        assert result["token_ids"] == run_to_completion(engine)["x"].token_ids
        # one host, yet not shared memory: the prefill node offers no region for a KV on a GPU
        assert result["timings"]["kv_transport"] in ("tcp", "tcp-layerwise")
        assert all(c.cmdline()[c.cmdline().index("--device") + 1] == "cuda" for c in children)
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0
