"""`pdserve plan`, the command: size a deployment before running it.

pdserve plan memory    weights, KV per token, tokens a node holds (memory.py)
pdserve plan profile   measure this hardware and model (profile.py)
pdserve plan simulate  predict one deployment on a workload (simulator.py)
pdserve plan best      the best deployment for a workload, SLOs and a budget of cores or GPUs (search.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random

from engine.config import DTYPES, GIB, EngineConfig
from pdserve import trace
from pdserve.bench import add_temperature, length_sampler
from pdserve.bench_stats import format_report
from pdserve.plan import memory, profile, profile_file, search
from pdserve.plan.simulator import (
    ARRIVAL_JITTER_S,
    SPREAD,
    Deployment,
    Workload,
    conversations,
    simulate,
    synthetic,
    timing_spread,
    traced,
)
from router.config import RouterConfig
from serving.options import HelpFormatter, add_options

# the router's options a simulated deployment takes (Deployment's fields, named as the router's)
PLACEMENT_OPTIONS = ("local_prefill", "max_local_prefill_tokens", "late_binding", "max_local_prefill_tpot")

PERCENTILES = ("p50", "p95", "p99")
CONCURRENCY = 8  # a closed loop's requests in flight, by default
TRANSPORT_HELP = (
    "the KV hand-off between nodes, one the profile measured (default: what --kv-transport auto "
    "takes on one host, the first of " + ", ".join(search.TRANSPORTS) + " in the profile)"
)


def budget(args, prof: dict) -> tuple[int, bool]:
    """(budget, in GPUs): --cores for a CPU's profile, --gpus for a GPU's."""
    gpu = args.gpus is not None
    flag, other, unit = ("gpus", "cores", "a GPU") if gpu else ("cores", "gpus", "CPU cores")
    if gpu != search.on_gpu(prof):
        measured = prof["machine"]["gpu"] if search.on_gpu(prof) else "CPU cores"
        raise ValueError(
            f"--{flag} needs a profile measured on {unit}; {args.profile} was measured on {measured} (use --{other})"
        )
    n = getattr(args, flag)
    if n < 1:
        raise ValueError(f"--{flag} must be >= 1, got {n}")
    return n, gpu


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="plan", required=True)
    memory.add_args(sub)

    m = sub.add_parser(
        "profile",
        help="measure step times and KV hand-off on this machine",
        description=profile.__doc__.split("\n\n", 2)[2].replace("\n", " "),
        formatter_class=HelpFormatter,
    )
    m.add_argument("--model", default=EngineConfig.model, help="as the engine's --model")
    m.add_argument("--dtype", default=EngineConfig.dtype, choices=DTYPES, help="as the engine's --dtype")
    m.add_argument("--device", default=EngineConfig.device, help="as the engine's --device")
    m.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, one engine profile each")
    m.add_argument("--repeat", type=int, default=3, help="runs per measured size (median)")
    m.add_argument("--quick", action="store_true", help="a small grid (tests)")
    m.add_argument(
        "--kv-cache-gb",
        type=float,
        default=EngineConfig.kv_cache_bytes / GIB,
        help="the profiled engine's KV cache, each simulated engine's capacity (as the engine's --kv-cache-gb)",
    )
    m.add_argument("--out", required=True, help="the profile file to write (JSON)")

    s = sub.add_parser(
        "simulate", help="predict one deployment's TTFT, TPOT and goodput on a workload", formatter_class=HelpFormatter
    )
    _workload_args(s)
    s.add_argument("--colocated", type=int, default=0, help="colocated engines (else --prefill and --decode)")
    s.add_argument("--prefill", type=int, default=1, help="prefill nodes")
    s.add_argument("--decode", type=int, default=1, help="decode nodes")
    s.add_argument("--threads", type=int, default=1, help="torch threads per engine (a thread count profiled)")
    add_options(s, RouterConfig, title="the router's placement", only=PLACEMENT_OPTIONS)
    add_options(s, EngineConfig, title="the engines", only=("prefill_tokens_with_decodes",))
    s.add_argument("--transport", default=None, help=TRANSPORT_HELP)
    s.add_argument(
        "--timing-seeds",
        type=int,
        default=0,
        help=f"K runs, seeds 0..K-1, each request's arrival and an idle engine's start late by up to "
        f"{ARRIVAL_JITTER_S * 1e3:g} ms: the median and range of each figure (with --json: "
        "{timing_seeds, spread, runs}); 0: one run, arrivals on time",
    )

    b = sub.add_parser(
        "best",
        help="the best deployment for a workload, SLOs and a budget of cores or GPUs, and the runner-up",
        description=search.__doc__.split("\n\n", 1)[1].replace("\n", " "),
        formatter_class=HelpFormatter,
    )
    _workload_args(b)
    budget = b.add_mutually_exclusive_group(required=True)
    budget.add_argument("--cores", type=int, help="cores to spend (each engine: its threads' worth; a CPU's profile)")
    budget.add_argument("--gpus", type=int, help="GPUs to spend (each engine: one; a GPU's profile)")
    b.add_argument("--percentile", default="p95", choices=PERCENTILES, help="where the SLOs apply")
    b.add_argument("--transport", default=None, help=TRANSPORT_HELP)
    b.add_argument("--top", type=int, default=2, help="deployments shown")


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a file written by `pdserve plan profile`")
    p.add_argument("--num-requests", type=int, default=32, help="requests (or conversations, with --turns)")
    p.add_argument("--prompt-len", default="uniform:590:630", help="N, uniform:A:B or normal:MEAN:STD tokens")
    p.add_argument("--output-len", default="64", help="N, uniform:A:B or normal:MEAN:STD tokens")
    p.add_argument("--turns", type=int, default=0, help="multi-turn chat: turns per conversation (0: single prompts)")
    p.add_argument("--system-len", type=int, default=0, help="multi-turn: a system prompt every conversation shares")
    p.add_argument(
        "--concurrency", type=int, default=None, help=f"closed loop: requests in flight (default: {CONCURRENCY})"
    )
    p.add_argument("--rate", type=float, default=None, help="open loop: requests/s (Poisson), instead")
    p.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="seconds per output token")
    p.add_argument("--seed", type=int, default=0, help="the workload's random prompts and lengths (default: 0)")
    add_temperature(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    trace.add_args(p)


def workload(args) -> Workload:
    return dataclasses.replace(_items(args), temperature=args.temperature)


def _items(args) -> Workload:
    if args.trace:
        if args.turns or args.system_len or args.rate or args.concurrency is not None:
            raise ValueError(
                "--trace sets the arrivals and the prompts: leave out --turns, --system-len, --rate and --concurrency"
            )
        requests = trace.read(args.trace, args.trace_speedup, args.trace_block_tokens)
        return traced(requests, args.trace_block_tokens, args.seed)
    loop = (
        {"rate": args.rate}
        if args.rate
        else {"concurrency": CONCURRENCY if args.concurrency is None else args.concurrency}
    )
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if not args.turns:
        return synthetic(args.num_requests, args.prompt_len, args.output_len, args.seed, **loop)
    rng = random.Random(args.seed)
    system = [rng.randrange(1, 1 << 30) for _ in range(args.system_len)]
    turn_len, answer_len = length_sampler(args.prompt_len, rng), length_sampler(args.output_len, rng)
    convs = [
        [(system if k == 0 else []) + [rng.randrange(1, 1 << 30) for _ in range(turn_len())] for k in range(args.turns)]
        for _ in range(args.num_requests)
    ]
    return conversations(convs, answer_len(), seed=args.seed, **loop)


def _simulate(args, prof: dict) -> int:
    dep = Deployment(
        "simulated",
        colocated=args.colocated,
        prefill=0 if args.colocated else args.prefill,
        decode=0 if args.colocated else args.decode,
        threads=args.threads,
        local_prefill=args.local_prefill,
        max_local_tokens=args.max_local_prefill_tokens,
        late_binding=args.late_binding,
        max_local_tpot=args.max_local_prefill_tpot,  # (PLACEMENT_OPTIONS)
        prefill_tokens_with_decodes=args.prefill_tokens_with_decodes,
        transport=args.transport or search.default_transport(prof),
        gpu=search.on_gpu(prof),
    )
    if args.timing_seeds < 0:
        raise ValueError(f"--timing-seeds must be >= 0, got {args.timing_seeds}")
    work = workload(args)
    if not args.timing_seeds:
        rep = simulate(prof, dep, work, args.slo_ttft, args.slo_tpot)
        print(json.dumps(rep.to_dict()) if args.json else format_report(rep, f"{dep.describe()}: "))
        return 0
    reps = [simulate(prof, dep, work, args.slo_ttft, args.slo_tpot, seed) for seed in range(args.timing_seeds)]
    spread = timing_spread(reps)
    if args.json:
        print(json.dumps({"timing_seeds": args.timing_seeds, "spread": spread, "runs": [r.to_dict() for r in reps]}))
        return 0
    seeds = f"seeds 0-{args.timing_seeds - 1}"
    print(f"{dep.describe()}: over {args.timing_seeds} arrival timings ({seeds}), median [min - max]")
    for name in SPREAD:
        f = spread[name]
        print(f"  {name:12s} {f['median']:.4g} [{f['min']:.4g} - {f['max']:.4g}]")
    return 0


def main(args) -> int:
    if args.plan == "memory":
        return memory.main(args)
    if args.plan == "profile":
        threads = [int(t) for t in args.threads.split(",")]
        if not threads or min(threads) < 1 or args.repeat < 1:
            raise ValueError("--threads must list thread counts >= 1 and --repeat be >= 1")
        kv_bytes = int(args.kv_cache_gb * GIB)
        result = profile.profile(args.model, args.dtype, args.device, threads, args.repeat, args.quick, kv_bytes)
        profile_file.write(result, args.out)
        print(f"wrote {args.out}: engines of {args.threads} thread(s), hand-off over {', '.join(result['handoff'])}")
        return 0
    prof = profile_file.load(args.profile)
    if args.plan == "simulate":
        return _simulate(args, prof)
    n, gpu = budget(args, prof)
    ranked = search.rank(
        prof,
        workload(args),
        n,
        args.slo_ttft,
        args.slo_tpot,
        args.percentile,
        args.transport or search.default_transport(prof),
        gpu,
    )
    top = ranked[: max(1, args.top)]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "deployment": s.deployment.describe(),
                        "command": search.command(s.deployment),
                        "meets_slos": s.meets,
                        "headroom": s.headroom,
                        "report": s.report.to_dict(),
                    }
                    for s in top
                ]
            )
        )
        return 0
    print(
        f"{len(ranked)} deployments of <= {n} {'GPUs' if gpu else 'cores'} simulated; "
        f"{sum(s.meets for s in ranked)} meet the SLOs"
    )
    for place, s in zip(("best", "runner-up", *(f"#{i}" for i in range(3, 100))), top):
        verdict = "meets the SLOs" if s.meets else "misses the SLOs (closest)"
        print(f"{place}: {s.deployment.describe()} ({verdict})\n  run: {search.command(s.deployment)}")
        print(format_report(s.report, "  "))
        if s is ranked[0]:
            print("  why: " + why(s, "GPUs" if gpu else "cores", args.percentile))
    return 0


def why(best: search.Scored, unit: str, percentile: str) -> str:
    if not best.tied:
        return f"the highest goodput, {best.report.goodput_tps:.1f} tokens/s"
    room = f"its TTFT and TPOT {percentile} at most {1 / best.headroom:.0%} of the SLOs" if best.headroom else ""
    if best.meets:
        then = f"of those it spends the fewest {unit} ({best.deployment.spends})" + (
            f", then leaves the most headroom: {room}" if room else ""
        )
    else:
        then = "of those it misses the SLOs the least" + (f": {room}" if room else "")
    return f"{best.tied + 1} deployments tie on goodput (within {search.TIE:.0%} of the highest): {then}"
