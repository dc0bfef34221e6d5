"""Does a greedy request's output change when it shares its steps with one other request?

    python benchmarks/batch_variance.py [--dtype auto] [--max-tokens 192]

The 16 prompts of benchmarks/speculative.py, each run alone and then beside the next prompt, on
one engine (the default model, prefix caching off), greedy; prints where the two outputs part.
Speculative decoding's verification is such a batch (k + 1 rows instead of 1), so this is the
yardstick for the bf16 drift it shows (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse

from speculative import workloads

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tokenizer import apply_chat_template


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=192)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, enable_prefix_caching=False, kv_cache_bytes=256 << 20))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)

    def run(prompts: list[list[int]]) -> list[int]:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return done["r0"]

    tok = engine.tokenizer
    prompts = [tok.encode(apply_chat_template(tok, c)) for w in workloads().values() for c in w]
    differ = 0
    for i, prompt in enumerate(prompts):
        alone, paired = run([prompt]), run([prompt, prompts[(i + 1) % len(prompts)]])
        if alone != paired:
            differ += 1
            at = next(j for j, (a, b) in enumerate(zip(alone + [-1], paired + [-2])) if a != b)
            print(f"prompt {i}: differs from token {at} of {len(alone)}", flush=True)
    print(
        f"{differ} of {len(prompts)} greedy outputs change when batched with one other request (dtype {engine.dtype})"
    )


if __name__ == "__main__":
    main()
