"""How long one prompt's prefill takes on one core, and (with --profile) where the time goes.

    taskset -c 1 python benchmarks/prefill_step.py [--tokens 610] [--prompts 1] [--profile]

The default model, one torch thread, prefix caching off, random prompt tokens; the median of 3
timed runs after a warm-up. To compare two trees, run it in each, alternating; the venv's
editable install points at this checkout, so name the other one first on the path:

    git worktree add /tmp/before <commit>
    cd /tmp/before && PYTHONPATH=/tmp/before taskset -c 1 python benchmarks/prefill_step.py
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=610)
    ap.add_argument("--prompts", type=int, default=1, help="prompts prefilled together")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--profile", action="store_true", help="print the torch profiler's table of one run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(dtype=args.dtype, enable_prefix_caching=False))
    rng = random.Random(0)
    runs = iter(range(1 << 30))

    def run() -> tuple[float, int]:
        r = next(runs)
        for i in range(args.prompts):
            engine.add_request(
                f"p{r}-{i}", [rng.randrange(100, 40000) for _ in range(args.tokens)], SamplingParams(max_tokens=1)
            )
        faults, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    run()
    timed = [run() for _ in range(3)]
    ms = statistics.median(t for t, _ in timed) * 1e3
    faults = statistics.median(f for _, f in timed)
    print(f"prefill of {args.prompts} x {args.tokens} tokens: {ms:.0f} ms, {faults:.0f} minor page faults")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
