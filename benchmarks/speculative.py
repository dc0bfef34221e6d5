"""Single-stream TPOT with and without n-gram speculative decoding, on a copy-heavy and a no-copy workload.

    python benchmarks/speculative.py [--k 4 8] [--rounds 3] [--max-tokens 192] [--draft-model M] [--json out.json]

Copy-heavy: "repeat this code" / "add a docstring to this code" prompts over functions of this
repository (the output copies the prompt). No-copy: open questions (nothing to copy). One engine
per setting (the default model, dtype auto, both cores), loaded once; each round runs every
prompt once on every engine, one request at a time, interleaved, so every setting sees the same
machine state. TPOT per request = (finish - first token) / (tokens - 1); figures are medians over
prompts and rounds, and the speed-up is the median of per-request ratios against no speculation.
Greedy, so every setting must produce the very same tokens (checked).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tokenizer import apply_chat_template


def code_samples() -> list[str]:
    from engine import block_manager, kv_cache, sampler, speculative

    funcs = [
        block_manager.chain_hash,
        block_manager.block_hashes,
        block_manager.BlockManager.trim,
        block_manager.BlockManager.acquire_prefix,
        kv_cache.KVCache.import_kv,
        sampler.apply_top_k_top_p,
        speculative.ngram_draft,
        speculative.first_rejected,
    ]
    return [inspect.getsource(f) for f in funcs]


def workloads() -> dict[str, list[list[dict]]]:
    code = code_samples()
    copy = [
        [{"role": "user", "content": f"Repeat this Python code exactly, without any change:\n\n{c}"}] for c in code[:4]
    ]
    copy += [
        [{"role": "user", "content": f"Add a one-line comment above each line of this code:\n\n{c}"}] for c in code[4:]
    ]
    questions = [
        "Write a short story about a lighthouse keeper and a storm.",
        "Explain why the sky is blue to a ten-year-old.",
        "What are the benefits of regular exercise? Give several reasons.",
        "Describe a day in the life of a medieval baker.",
        "Write a poem about the ocean at night.",
        "How do airplanes stay in the air?",
        "Give advice to someone starting their first job.",
        "Describe the water cycle in detail.",
    ]
    return {"copy": copy, "no-copy": [[{"role": "user", "content": q}] for q in questions]}


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    engine.add_request("r", prompt, params)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None:
                first = time.perf_counter()
            if out.finished:
                tokens = out.token_ids
    end = time.perf_counter()
    return tokens, (end - first) / max(len(tokens) - 1, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8], help="num_speculative_tokens settings to compare")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--draft-model",
        default=None,
        help="also compare the draft-model proposer with this draft (the model itself: the overhead ceiling)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    settings = {"none": None, **{f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": k} for k in args.k}}
    if args.draft_model:
        settings.update(
            {
                f"draft k={k}": {"method": "draft_model", "draft_model": args.draft_model, "num_speculative_tokens": k}
                for k in args.k
            }
        )
    engines = {
        name: LLMEngine(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                speculative=spec,
                enable_prefix_caching=False,
                kv_cache_bytes=256 << 20,
            )
        )
        for name, spec in settings.items()
    }
    tok = engines["none"].tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    tpot = {w: {name: [] for name in settings} for w in ("copy", "no-copy")}
    ratios = {w: {name: [] for name in settings if name != "none"} for w in tpot}
    lengths = {w: [] for w in tpot}
    mismatches = []
    for engine in engines.values():  # warm-up
        run_one(engine, tok.encode("Hello"), SamplingParams(max_tokens=8, temperature=0))
    counts = {w: {name: [0, 0, 0] for name in settings} for w in tpot}  # verifications, drafted, accepted

    def counters(engine: LLMEngine) -> list[int]:
        return [engine.num_verifications, engine.num_draft_tokens, engine.num_accepted_tokens]

    for r in range(args.rounds):
        for workload, conversations in workloads().items():
            before = {name: counters(engine) for name, engine in engines.items()}
            for conv in conversations:
                prompt = tok.encode(apply_chat_template(tok, conv))
                results = {name: run_one(engine, prompt, params) for name, engine in engines.items()}
                base_tokens, base_tpot = results["none"]
                for name, (tokens, t) in results.items():
                    if tokens != base_tokens:
                        same = next(i for i, (a, b) in enumerate(zip(tokens + [-1], base_tokens + [-2])) if a != b)
                        mismatches.append(f"{workload} {name}: tokens differ from token {same} of {len(base_tokens)}")
                        print(mismatches[-1], flush=True)
                    tpot[workload][name].append(t)
                    if name != "none":
                        ratios[workload][name].append(base_tpot / t)
                lengths[workload].append(len(base_tokens))
            for name, engine in engines.items():
                counts[workload][name] = [
                    c + now - b for c, now, b in zip(counts[workload][name], counters(engine), before[name])
                ]
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    summary = {
        "model": args.model,
        "dtype": str(engines["none"].dtype),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "workloads": {},
        "mismatches": mismatches,
    }
    for workload in tpot:
        rows = {}
        for name in settings:
            row = {"tpot_ms_median": 1000 * statistics.median(tpot[workload][name])}
            if name != "none":
                verifications, drafted, accepted = counts[workload][name]
                row.update(
                    speedup_median=statistics.median(ratios[workload][name]),
                    acceptance_rate=accepted / max(drafted, 1),
                    tokens_per_verification=(accepted + verifications) / max(verifications, 1),
                )
            rows[name] = row
        summary["workloads"][workload] = {
            "output_tokens_median": statistics.median(lengths[workload]),
            "settings": rows,
        }
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
