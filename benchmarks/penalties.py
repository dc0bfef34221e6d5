"""The sampling penalties' cost on the default model, measured in one run: decoding with presence,
frequency and repetition penalties against the same requests without, and the penalties' own time
per step.

    python benchmarks/penalties.py [--num-prompts 32] [--max-tokens 64] [--runs 3] [--json FILE]

Each run is one process (the engine warmed up on the same batch first; the modes' order alternates
between runs): the same chat prompts (engine_throughput.py),
greedy, plain then penalized (presence 0.5, frequency 0.5, repetition 1.2: every row pays the
counts of its output and, for the repetition penalty, of its prompt), ignore_eos so both modes
generate every token. Per mode, tokens/s = generated tokens / the generate's wall time; penalized,
the seconds spent in engine.penalties.apply_penalties over the steps. Reported: medians over runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.summary import emit, median_of, ratio  # noqa: E402

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}


def one_run(num_prompts: int, max_tokens: int, penalized_first: bool) -> dict:
    from engine_throughput import chat_prompts

    from engine import LLM, SamplingParams, sampler

    llm = LLM(kv_cache_bytes=1 << 30)
    prompts = chat_prompts(llm.engine.tokenizer, num_prompts)
    seconds, calls = [0.0], [0]
    plain = sampler.apply_penalties

    def timed(*args):
        t = time.perf_counter()
        out = plain(*args)
        seconds[0] += time.perf_counter() - t
        calls[0] += 1
        return out

    sampler.apply_penalties = timed
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up, the same shapes
    out = {}
    modes = [("plain", {}), ("penalized", PENALTIES)]
    for mode, extra in reversed(modes) if penalized_first else modes:
        seconds[0], calls[0] = 0.0, 0
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.token_ids) for o in outs)
        out[mode] = {
            "tokens_per_s": generated / elapsed,
            "generated_tokens": generated,
            "elapsed_s": elapsed,
            "penalties_s": seconds[0],
            "penalized_steps": calls[0],
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs; figures are their medians")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()
    runs = [one_run(args.num_prompts, args.max_tokens, penalized_first=i % 2 == 1) for i in range(args.runs)]
    penalized = lambda r: r["penalized"]  # noqa: E731
    summary = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "penalties": PENALTIES,
        "runs": runs,
        "median": {
            "plain_tokens_per_s": median_of(runs, lambda r: r["plain"]["tokens_per_s"]),
            "penalized_tokens_per_s": median_of(runs, lambda r: penalized(r)["tokens_per_s"]),
            "penalties_ms_per_step": 1000
            * median_of(runs, lambda r: penalized(r)["penalties_s"] / max(penalized(r)["penalized_steps"], 1)),
            "penalties_share_of_penalized_time": median_of(
                runs, lambda r: penalized(r)["penalties_s"] / penalized(r)["elapsed_s"]
            ),
        },
        "ratio_penalized_over_plain": ratio(
            runs, lambda r: penalized(r)["tokens_per_s"], lambda r: r["plain"]["tokens_per_s"]
        ),
    }
    emit(summary, args.json)


if __name__ == "__main__":
    main()
