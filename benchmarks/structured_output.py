"""Structured output's cost on the default model, measured in one run: the grammar's compile time
and the token mask's time per step against the step itself, beside unconstrained decoding.

    python benchmarks/structured_output.py [--num-prompts 32] [--max-tokens 64] [--runs 3] [--json FILE]

Each run is one process (the engine warmed up first): the same chat prompts (engine_throughput.py),
greedy, unconstrained then under a JSON schema (an array of strings: outputs long enough that
most rows are masked every step). Per mode, tokens/s = generated tokens / the generate's wall
time; under the schema, the seconds spent computing and applying masks (ModelRunner._mask) over
the engine's steps. Compile: the first request's grammar work (the llguidance tokenizer and the
schema's check) and a cached repeat. Reported: medians over runs, and the mask's share of a step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.summary import emit, median_of, ratio  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 3},
        "score": {"type": "integer"},
    },
    "required": ["title", "tags", "score"],
}


def one_run(num_prompts: int, max_tokens: int) -> dict:
    from engine_throughput import chat_prompts

    from engine import LLM, SamplingParams
    from engine.structured_output import GrammarCompiler, StructuredOutput

    llm = LLM(kv_cache_bytes=1 << 30)
    engine = llm.engine
    prompts = chat_prompts(engine.tokenizer, num_prompts)
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    cfg = engine.model_config
    start = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    compiler.compile(so)
    first_compile = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(so)
    cached_compile = time.perf_counter() - start
    engine.runner.grammars = compiler

    runner, mask_seconds, mask_calls = engine.runner, [0.0], [0]
    plain_mask = runner._mask

    def timed_mask(*args):
        t = time.perf_counter()
        plain_mask(*args)
        mask_seconds[0] += time.perf_counter() - t
        mask_calls[0] += 1

    runner._mask = timed_mask
    out = {"first_compile_s": first_compile, "cached_compile_s": cached_compile}
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    for mode, params in (
        ("unconstrained", SamplingParams(max_tokens=max_tokens, temperature=0)),
        ("json_schema", SamplingParams(max_tokens=max_tokens, temperature=0, structured_output=so)),
    ):
        mask_seconds[0], mask_calls[0] = 0.0, 0
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.token_ids) for o in outs)
        out[mode] = {
            "tokens_per_s": generated / elapsed,
            "generated_tokens": generated,
            "elapsed_s": elapsed,
            "mask_s": mask_seconds[0],
            "steps": mask_calls[0],  # every step with logits calls it (unconstrained: returns at once)
            "finished_by_eos": sum(o.finish_reason == "stop" for o in outs),
        }
        if mode == "json_schema":
            valid = 0
            for o in outs:
                try:
                    json.loads(o.text)
                    valid += 1
                except ValueError:
                    pass
            out[mode]["valid_json"] = valid
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs; figures are their medians")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()
    runs = [one_run(args.num_prompts, args.max_tokens) for _ in range(args.runs)]
    constrained = lambda r: r["json_schema"]  # noqa: E731
    summary = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "median": {
            "first_compile_ms": 1000 * median_of(runs, lambda r: r["first_compile_s"]),
            "cached_compile_ms": 1000 * median_of(runs, lambda r: r["cached_compile_s"]),
            "unconstrained_tokens_per_s": median_of(runs, lambda r: r["unconstrained"]["tokens_per_s"]),
            "json_schema_tokens_per_s": median_of(runs, lambda r: constrained(r)["tokens_per_s"]),
            "mask_ms_per_step": 1000
            * median_of(runs, lambda r: constrained(r)["mask_s"] / max(constrained(r)["steps"], 1)),
            "mask_share_of_constrained_time": median_of(
                runs, lambda r: constrained(r)["mask_s"] / constrained(r)["elapsed_s"]
            ),
        },
        "ratio_constrained_over_unconstrained": ratio(
            runs, lambda r: constrained(r)["tokens_per_s"], lambda r: r["unconstrained"]["tokens_per_s"]
        ),
    }
    emit(summary, args.json)


if __name__ == "__main__":
    main()
