"""Weight-only int8 and int4 against the default dtype on the default model, measured in one run:
a lone stream and a batch, and each mode's logits consistency (KL against fp32).

    python benchmarks/quantization.py [--model M] [--no-accuracy] [--runs 3] [--json FILE]

Each run is one process with three engines, the model dtype (`--dtype auto`) and the same with
`--quantization int8` and `int4`, warmed up, then each workload on each engine, the engines'
order rotating between runs: a lone stream (1 chat prompt x 128 tokens) and a batch (32 x 64),
greedy, ignore_eos; tokens/s = generated tokens / wall time. Accuracy (once): on 32 chat
prompts, the next-token distribution after each prompt, KL(fp32 || mode) for bf16 and each
quantization with bf16 and with fp32 activations, and how many greedy tokens equal fp32's.
Reported: medians over runs and per-run ratios.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.summary import emit, median_of, ratio  # noqa: E402

WORKLOADS = {"lone": (1, 128), "batch": (32, 64)}
QUANTIZED = ("int8", "int4")
MODES = ("none", *QUANTIZED)


def next_logprobs(llm, prompts: list[list[int]]) -> torch.Tensor:
    from engine.sampling_params import SamplingParams
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence

    engine, rows = llm.engine, []
    for prompt in prompts:
        seq = Sequence("kl", list(prompt), SamplingParams(temperature=0))
        engine.block_manager.allocate(seq, seq.num_tokens)
        _, _, logits = engine.runner.forward(ScheduledBatch([seq], [seq.num_tokens]))
        engine.block_manager.free(seq)
        rows.append(logits[0].float().log_softmax(-1))
    return torch.stack(rows)


def accuracy(prompts: list[list[int]]) -> dict:
    from engine import LLM

    modes = {
        "bfloat16": dict(dtype="bfloat16"),
        **{
            f"{q} ({a} activations)": dict(dtype=dtype, quantization=q)
            for q in QUANTIZED
            for a, dtype in (("bf16", "bfloat16"), ("fp32", "float32"))
        },
    }
    ref = next_logprobs(LLM(dtype="float32", kv_cache_bytes=1 << 28), prompts)
    out = {}
    for name, kwargs in modes.items():
        got = next_logprobs(LLM(kv_cache_bytes=1 << 28, **kwargs), prompts)
        kl = (ref.exp() * (ref - got)).sum(-1)
        out[name] = {
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "greedy_equal": int((ref.argmax(-1) == got.argmax(-1)).sum()),
            "prompts": len(prompts),
        }
    return out


def one_run(model: str, first: int) -> dict:
    from engine_throughput import chat_prompts

    from engine import LLM, SamplingParams

    engines = {q: LLM(model, kv_cache_bytes=1 << 30, quantization=q) for q in MODES}
    prompts = chat_prompts(engines["none"].engine.tokenizer, 32)
    for llm in engines.values():
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    out = {"dtype": str(engines["none"].engine.dtype).removeprefix("torch.")}
    for q in MODES[first:] + MODES[:first]:
        for workload, (n, max_tokens) in WORKLOADS.items():
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            start = time.perf_counter()
            outs = engines[q].generate(prompts[:n], params)
            elapsed = time.perf_counter() - start
            out[f"{q}/{workload}"] = sum(len(o.token_ids) for o in outs) / elapsed
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="the model timed (e.g. a random twin's directory)")
    ap.add_argument("--no-accuracy", dest="accuracy", action="store_false", help="time only (a random twin)")
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs; figures are their medians")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()
    from engine.hardware import cpu_features

    runs = [one_run(args.model, first=i % len(MODES)) for i in range(args.runs)]
    from engine_throughput import chat_prompts

    from engine import LLM

    summary = {
        "model": args.model,
        "cpu_class": cpu_features().isa,
        "workloads": {k: {"prompts": n, "max_tokens": m} for k, (n, m) in WORKLOADS.items()},
        "runs": runs,
        "median": {key: median_of(runs, lambda r, key=key: r[key]) for key in runs[0] if key != "dtype"},
        **{
            f"ratio_{q}_over_default": {
                w: ratio(runs, lambda r, w=w, q=q: r[f"{q}/{w}"], lambda r, w=w: r[f"none/{w}"]) for w in WORKLOADS
            }
            for q in QUANTIZED
        },
    }
    if args.accuracy:  # the default model only: a random twin's distributions are not a model's
        tokenizer = LLM(kv_cache_bytes=1 << 26).engine.tokenizer
        summary["accuracy_against_fp32"] = accuracy(chat_prompts(tokenizer, 32))  # token ids
    emit(summary, args.json)


if __name__ == "__main__":
    main()
