"""What n = 4 samples cost against n = 1: the prefill, and the KV moved between the pools.

    python benchmarks/parallel_sampling.py [--prompt-lens 256 1024] [--rounds 5] [--json out.json]

1. Engine (the default model, dtype auto, both cores): the time from adding a request until every
   sample has its first token: n = 1 is one prefill step; n = 4 is the same prefill, then the fork
   and one step in which the three other samples compute their last prompt token. Compared with
   4 separate requests of the same prompt (no sharing: prefix caching off). Median over rounds.
2. Cluster (`pdserve up`, 1 prefill + 1 decode node): n = 1 and n = 4 requests of the same
   prompts, alternating; from each response's timings: the prefill node's prefill seconds and the
   KV bytes the decode node read. Medians; n = 4 must move the same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from disagg_vs_colocated import wait_line

from engine import EngineConfig, LLMEngine, SamplingParams


def until_first_tokens(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Seconds until every sample of every prompt has produced a token; then the requests are aborted."""
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    waiting = {(f"r{i}", j) for i in range(len(prompts)) for j in range(params.n)}
    while waiting:
        for out in engine.step():
            waiting.discard((out.request_id, out.index))
    seconds = time.perf_counter() - start
    for i in range(len(prompts)):
        engine.abort_request(f"r{i}")
    return seconds


def engine_part(prompt_lens: list[int], rounds: int) -> dict:
    engine = LLMEngine(EngineConfig(enable_prefix_caching=False, kv_cache_bytes=512 << 20))
    vocab = engine.model_config.vocab_size
    results = {}
    until_first_tokens(engine, [[1] * 64], SamplingParams(max_tokens=2))  # warm-up
    for length in prompt_lens:
        times = {"n=1": [], "n=4": [], "4 requests": []}
        for r in range(rounds):
            prompt = [(r * 7919 + i * 104729) % (vocab - 1) + 1 for i in range(length)]
            params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
            times["n=1"].append(until_first_tokens(engine, [prompt], params))
            times["n=4"].append(
                until_first_tokens(
                    engine, [prompt], SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, n=4)
                )
            )
            times["4 requests"].append(until_first_tokens(engine, [prompt] * 4, params))
        med = {k: statistics.median(v) for k, v in times.items()}
        results[length] = {
            "seconds_median": med,
            "n4_over_n1": med["n=4"] / med["n=1"],
            "4_requests_over_n1": med["4 requests"] / med["n=1"],
        }
        print(f"engine, prompt {length}: {json.dumps(results[length])}", flush=True)
    return results


def cluster_part(prompt_lens: list[int], rounds: int) -> dict:
    from router.client import Client

    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--port",
            "0",
            "--num-threads",
            "1",
            "--pin-cpus",
            "--kv-cache-gb",
            "0.5",
            "--local-prefill",
            "off",
            "--no-prefix-caching",
        ],  # n=1 and n=4 send the same prompt: no reuse between them
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = wait_line(up, up.stderr, "pdserve up: router on").split()[4]
        client = Client(address)
        vocab = 49152
        results = {}
        client.generate([1] * 64, max_tokens=2)  # warm-up
        for length in prompt_lens:
            rows = {"n=1": [], "n=4": []}
            for r in range(rounds):
                prompt = [(r * 7919 + i * 104729 + length) % (vocab - 1) + 1 for i in range(length)]
                for n in (1, 4):
                    out = client.generate(prompt, max_tokens=8, temperature=1.0, ignore_eos=True, n=n)
                    t = out.timings
                    rows[f"n={n}"].append(
                        {
                            "prefill_s": t["prefill_end"] - t["prefill_start"],
                            "kv_bytes": int(t["kv_bytes"]),
                            "completion_tokens": out.usage["completion_tokens"],
                        }
                    )
            summary = {}
            for k, v in rows.items():
                summary[k] = {
                    "prefill_s_median": statistics.median(x["prefill_s"] for x in v),
                    "kv_bytes_median": statistics.median(x["kv_bytes"] for x in v),
                    "completion_tokens": v[0]["completion_tokens"],
                }
            summary["prefill_n4_over_n1"] = summary["n=4"]["prefill_s_median"] / summary["n=1"]["prefill_s_median"]
            summary["kv_bytes_n4_over_n1"] = summary["n=4"]["kv_bytes_median"] / summary["n=1"]["kv_bytes_median"]
            results[length] = summary
            print(f"cluster, prompt {length}: {json.dumps(summary)}", flush=True)
        return results
    finally:
        up.terminate()
        up.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = {
        "engine": engine_part(args.prompt_lens, args.rounds),
        "cluster": cluster_part(args.prompt_lens, args.rounds),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
