"""A burst of requests on one uncached system prompt: what computing the prompt once saves.

    python benchmarks/shared_prefix_burst.py [--before 946394b] [--rounds 3] [--requests 8] [--json FILE]

N requests (one ~1,000-token system prompt, then a ~40-token question each; 32 tokens out, greedy,
ignore_eos) reach the offline engine (default model, dtype auto, one torch thread) in the same
instant, as a prefill node gets them when a burst arrives after a deploy or an idle spell. Timed
per request: the first token after the burst (TTFT) and the prompt tokens its prefill found in the
cache; per run, the whole burst's seconds. This tree's scheduler, where a prompt whose next block
another prefill is computing waits for it, against the scheduler of --before (a git revision, run
from a temporary worktree), where each computes the system prompt beside the others; each run its
own process, the two interleaved. Reports medians over the rounds and the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VOCAB = (100, 49000)


def child(num_requests: int) -> dict:
    """One burst in this process, on the engine of the tree this file was run from."""
    import random

    import torch

    from engine import EngineConfig, SamplingParams
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    rng = random.Random(0)
    system = [rng.randrange(*VOCAB) for _ in range(1000)]
    prompts = [system + [rng.randrange(*VOCAB) for _ in range(rng.randint(30, 50))] for _ in range(num_requests)]
    engine = LLMEngine(EngineConfig())
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    engine.add_request("warm-up", [rng.randrange(*VOCAB) for _ in range(64)], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    began = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    ttft, cached = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in ttft and out.token_ids:
                ttft[out.request_id] = time.perf_counter() - began
                cached[out.request_id] = out.num_cached_tokens
    return {
        "seconds": time.perf_counter() - began,
        "ttft_s": [ttft[str(i)] for i in range(num_requests)],
        "cached_tokens": [cached[str(i)] for i in range(num_requests)],
        "prompt_tokens": sum(len(p) for p in prompts),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "engine": str(Path(sys.modules["engine"].__file__).resolve()),
    }


def run(tree: Path, num_requests: int) -> dict:
    """One burst in a process of its own on tree's engine (PYTHONPATH puts it first)."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--requests", str(num_requests)],
        cwd=tree,
        env=dict(os.environ, PYTHONPATH=str(tree)),
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["engine"].startswith(str(tree)), f"ran {result['engine']}, not {tree}'s engine"
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="946394b", help="the revision whose scheduler is the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.requests)))
        return 0
    with tempfile.TemporaryDirectory(prefix="pdserve-burst-") as tmp:
        before_tree = Path(tmp) / "before"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(before_tree), args.before], cwd=ROOT, check=True
        )
        try:
            runs = {"before": [], "after": []}
            for r in range(args.rounds):
                order = (("before", before_tree), ("after", ROOT))
                for name, tree in order if r % 2 == 0 else order[::-1]:
                    runs[name].append(run(tree, args.requests))
                    res = runs[name][-1]
                    print(
                        f"round {r} {name:6s}: burst {res['seconds']:.2f} s, TTFT p50 "
                        f"{statistics.median(res['ttft_s']):.2f} s, cached {res['cached_tokens']}",
                        flush=True,
                    )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)], cwd=ROOT, check=False)
    summary = {}
    for name, rs in runs.items():
        summary[name] = {
            "burst_s": statistics.median(r["seconds"] for r in rs),
            "ttft_p50_s": statistics.median(statistics.median(r["ttft_s"]) for r in rs),
            "ttft_max_s": statistics.median(max(r["ttft_s"]) for r in rs),
            "cached_share": statistics.median(sum(r["cached_tokens"]) / r["prompt_tokens"] for r in rs),
        }
    pairs = list(zip(runs["before"], runs["after"]))  # the same round's
    ratios = {
        "burst_s": statistics.median(b["seconds"] / a["seconds"] for b, a in pairs),
        "ttft_p50_s": statistics.median(
            statistics.median(b["ttft_s"]) / statistics.median(a["ttft_s"]) for b, a in pairs
        ),
    }
    print(json.dumps({"medians": summary, "before_over_after": ratios}, indent=1))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
                    "date": time.strftime("%Y-%m-%d %H:%M"),
                    "before": args.before,
                    "requests": args.requests,
                    "runs": runs,
                    "medians": summary,
                    "before_over_after": ratios,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
