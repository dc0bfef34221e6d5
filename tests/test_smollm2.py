"""The real default model (SmolLM2-135M-Instruct) in fp32 against transformers: token-for-token
greedy equality and the logits-consistency check (KL divergence per step); bf16 against fp32; and
deterministic mode's same bits alone and in a batch, in both dtypes."""

from __future__ import annotations

import pytest
import torch
from conftest import run_to_completion
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, SamplingParams, cpu_kernels
from engine.hardware import cpu_features

pytestmark = pytest.mark.slow

NUM_TOKENS = 32
MESSAGES = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a short tip for writing clean Python code.",
    "What is 12 times 12?",
]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", device="cpu", kv_cache_bytes=256 << 20))


def test_greedy_tokens_and_kl_match_transformers(engine):
    tok = engine.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
        for m in MESSAGES
    ]
    # Record our next-token logits per request and step, as the sampler sees them.
    seen: dict[str, list[torch.Tensor]] = {}
    runner = engine.runner
    original_forward = runner.forward

    def recording_forward(batch):
        rows, counts, logits = original_forward(batch)
        for i, row in zip(rows, logits):
            seen.setdefault(batch.seqs[i].request_id, []).append(row.clone())
        return rows, counts, logits

    runner.forward = recording_forward
    try:
        params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
    finally:
        runner.forward = original_forward

    worst_kl = 0.0
    for i in range(len(prompts)):
        ids = torch.tensor([outs[str(i)].prompt_token_ids])
        # eos = an id the model cannot produce: generate runs all steps, as ignore_eos does (min_new_tokens
        # would instead mask EOS out of the distribution).
        ref = hf.generate(
            ids,
            max_new_tokens=NUM_TOKENS,
            do_sample=False,
            eos_token_id=hf.config.vocab_size,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert outs[str(i)].token_ids == ref.sequences[0, ids.shape[1] :].tolist(), MESSAGES[i]
        for ours, theirs in zip(seen[str(i)], ref.logits):
            p_ref = torch.log_softmax(theirs[0].float(), -1)
            p_ours = torch.log_softmax(ours, -1)
            kl = torch.sum(p_ref.exp() * (p_ref - p_ours)).item()
            worst_kl = max(worst_kl, kl)
    print(
        f"worst per-step KL(transformers || pdserve) over {len(prompts)} prompts x {NUM_TOKENS} tokens: {worst_kl:.2e}"
    )
    assert worst_kl < 1e-4, worst_kl


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-row KL(ref || other) in nats."""
    p = torch.log_softmax(ref_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return (p.exp() * (p - q)).sum(-1)


def test_bf16_is_as_close_to_fp32_as_transformers_bf16():
    """The bf16 fast path (prepacked linears, C++ attention and fused ops) against the fp32
    reference, teacher-forced on the same tokens: its mean KL is no worse than transformers' own
    bf16 model's (with a margin for rounding luck)."""
    engine = LLMEngine(EngineConfig(model="smollm2-135m", dtype="bfloat16", device="cpu", kv_cache_bytes=64 << 20))
    tok = engine.tokenizer
    ours: dict[str, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def recording_forward(batch):
        rows, counts, logits = forward(batch)
        for i, row in zip(rows, logits):
            ours.setdefault(batch.seqs[i].request_id, []).append(row.clone())
        return rows, counts, logits

    engine.runner.forward = recording_forward
    for i, m in enumerate(MESSAGES):
        p = tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
        engine.add_request(str(i), p, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    hf32 = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.bfloat16).eval()
    ours_kl, hf_kl = [], []
    for rid, out in outs.items():
        ids = torch.tensor([out.prompt_token_ids + out.token_ids[:-1]])
        n = len(out.prompt_token_ids)
        with torch.no_grad():
            ref = hf32(ids).logits[0, n - 1 :]
            theirs = hf16(ids).logits[0, n - 1 :]
        ours_kl.append(kl(ref, torch.stack(ours[rid])))
        hf_kl.append(kl(ref, theirs))
    ours_mean, hf_mean = torch.cat(ours_kl).mean().item(), torch.cat(hf_kl).mean().item()
    print(f"mean KL vs fp32 reference: pdserve bf16 {ours_mean:.2e}, transformers bf16 {hf_mean:.2e}")
    assert ours_mean < 2 * hf_mean + 1e-4


def chat_turns(dtype: str, caching: bool) -> list:
    """Four turns of one chat, each prompt holding the earlier turns: with prefix caching only the
    new turn is computed (over the cached KV). Returns each turn's final output (top-5 logprobs)."""
    engine = LLMEngine(
        EngineConfig(
            model="smollm2-135m", dtype=dtype, device="cpu", kv_cache_bytes=64 << 20, enable_prefix_caching=caching
        )
    )
    messages, outs = [{"role": "system", "content": "Answer briefly. " * 20}], []
    for i, question in enumerate(MESSAGES[:4]):
        messages.append({"role": "user", "content": question})
        prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        engine.add_request(f"t{i}", prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs.append(out)
                    messages.append({"role": "assistant", "content": out.text})
    return outs


def test_a_chat_with_cached_history_gives_the_same_tokens_in_fp32():
    """fp32: the answers over cached KV are the very tokens of computing every prompt whole."""
    whole, cached = chat_turns("float32", False), chat_turns("float32", True)
    assert [o.token_ids for o in cached] == [o.token_ids for o in whole]
    assert [o.num_cached_tokens for o in whole] == [0] * 4 and cached[0].num_cached_tokens == 0
    n = [o.num_cached_tokens for o in cached]
    assert 64 <= n[1] < n[2] < n[3]  # the system prompt, then each earlier turn


def test_a_chat_with_cached_history_stays_close_in_bf16():
    """bf16 rounds a prompt computed whole and the same prompt over KV from earlier steps
    differently, and how differs by CPU (AMX, AVX512_BF16 and Arm's kernels block the reductions
    their own way): what holds on every bf16 CPU is vLLM's check_logprobs_close rule. The greedy
    tokens agree until they part, and where they part each side's token is among the other's
    5 most likely; after that the chats differ (each next prompt holds the answer)."""
    whole, cached = chat_turns("bfloat16", False), chat_turns("bfloat16", True)
    assert cached[1].num_cached_tokens >= 64
    for turn, (a, b) in enumerate(zip(whole, cached)):
        for step, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                assert x in b.logprobs[step] and y in a.logprobs[step], (turn, step, x, y)
                return


def test_beam_search_equals_transformers(engine):
    """SmolLM2 in fp32: generate(num_beams=3, do_sample=False)'s hypotheses, token for token."""
    tok = engine.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    for i, m in enumerate(MESSAGES[:3]):
        ids = tok.encode(
            tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
        )
        out = hf.generate(
            torch.tensor([ids]),
            num_beams=3,
            num_return_sequences=3,
            do_sample=False,
            max_new_tokens=16,
            pad_token_id=tok.pad_token_id or 0,
            eos_token_id=eos,
        )
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        want = []
        for seq in out[:, len(ids) :].tolist():
            end = next((j for j, t in enumerate(seq) if t in eos_ids), len(seq) - 1)
            want.append(seq[: end + 1])
        engine.add_request(f"beam{i}", ids, SamplingParams(max_tokens=16, beam_width=3, n=3))
        got = {}
        while engine.has_unfinished():
            got.update({o.index: o.token_ids for o in engine.step() if o.request_id == f"beam{i}"})
        assert [got[j] for j in range(3)] == want, m


def greedy_runs(dtype: str, deterministic: bool) -> tuple[dict, dict]:
    """The 8 chat prompts, greedy with top-5 logprobs: (each alone, one after the other on an
    engine of the default token budget and no prefix cache; all together on one with 16-token
    steps: chunked prefills, up to 8 sequences decoding beside them, the chat template's first
    block from the prefix cache). Each: request id -> (tokens, logprobs)."""

    def engine(**kw) -> LLMEngine:
        config = EngineConfig(
            model="smollm2-135m", dtype=dtype, device="cpu", kv_cache_bytes=64 << 20, deterministic=deterministic, **kw
        )
        return LLMEngine(config)

    def finish(e: LLMEngine) -> dict:
        return {rid: (o.token_ids, o.logprobs) for rid, o in run_to_completion(e).items()}

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    one = engine(enable_prefix_caching=False)
    prompts = [
        one.tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
        for m in MESSAGES
    ]
    alone = {}
    for i, p in enumerate(prompts):
        one.add_request(str(i), p, params)
        alone.update(finish(one))
    together = engine(max_num_batched_tokens=16)
    for i, p in enumerate(prompts):
        together.add_request(str(i), p, params)
    return alone, finish(together)


@pytest.mark.skipif(not cpu_kernels.load(), reason="deterministic mode needs the C++ CPU kernels")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deterministic_mode_gives_the_default_model_the_same_bits_alone_and_in_a_chunked_batch(dtype):
    """Issue 28 on the default model: greedy tokens and top-5 logprobs, exactly equal."""
    alone, together = greedy_runs(dtype, deterministic=True)
    assert together == alone


@pytest.mark.skipif(not cpu_kernels.load(), reason="the control of a test that needs the C++ CPU kernels")
def test_without_deterministic_mode_the_default_model_parts_somewhere():
    """The control: the same runs with the mode off differ in a dtype (on this project's AVX2-only
    machine bf16 in 2 of 8 outputs, fp32 in 6). A CPU whose kernels keep both dtypes' rows the
    same whatever the batch has nothing here for the mode to fix: skipped, naming it."""
    differ = {}
    for dtype in ("bfloat16", "float32"):
        alone, together = greedy_runs(dtype, deterministic=False)
        differ[dtype] = sum(together[r] != alone[r] for r in alone)
    print(differ)
    if not any(differ.values()):
        pytest.skip(f"on this CPU ({cpu_features().isa}) neither dtype's outputs moved with the batch: {differ}")
