"""The planner's autoscaling policy against the threshold policies on one bursty trace, under Ray.

    python benchmarks/autoscale_trace.py --json docs/bench/autoscale_trace.json

A private local Ray cluster (this machine's cores); deploy/serve_config.yaml with the default
model (float32 where --dtype auto picks it), one torch thread an engine, each pool between 1 and
--max-replicas replicas. The same trace runs once per policy, in one window, each on a fresh
deployment: Poisson arrivals whose rate steps low -> burst -> low (--phases), prompts of
--prompt-len tokens, --output-len tokens out. The thresholds are the shipped ones
(deploy/serve_config.yaml); the planner's policy (pdserve.autoscaling:PlannerPolicy) reads the
profile `pdserve plan profile` measured here (--profile), the SLOs and the core budget (--cores,
this machine's by default). Measured per policy: SLO attainment (requests within both SLOs /
requests sent), TTFT and TPOT percentiles, and replica-seconds of Prefill and Decode (running or
starting replicas, sampled each second from serve.status()).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from ray_cluster import default_model_config, replica_counts, start_ray, stop_ray, wait_until  # noqa: E402

from pdserve import serve_config  # noqa: E402
from pdserve.bench import length_sampler, one_request  # noqa: E402
from pdserve.bench_stats import report  # noqa: E402
from pdserve.ray_serve import wait_running  # noqa: E402
from router.client import AsyncClient, Client  # noqa: E402

POOLS = ("Prefill", "Decode")
HELD = ("STARTING", "RUNNING", "UPDATING", "STOPPING")  # replica states that hold an engine's cores/memory


def config_for(policy: str, base: dict, args) -> dict:
    config = copy.deepcopy(base)
    app = config["applications"][0]
    if policy == "planner":
        app["autoscaling_policy"] = {
            "policy_function": "pdserve.autoscaling:PlannerPolicy",
            "policy_kwargs": {
                "profile": str(Path(args.profile).resolve()),
                "slo_ttft_s": args.slo_ttft,
                "slo_tpot_s": args.slo_tpot,
                "cores": args.cores or None,
            },
        }
    return config


def trace(args) -> list[tuple[float, list[int], int]]:
    """(send time, prompt, max_tokens) for every request, the same for every policy."""
    rng = random.Random(args.seed)
    plen, olen = length_sampler(args.prompt_len, rng), length_sampler(args.output_len, rng)
    out, start = [], 0.0
    for phase in args.phases.split(","):
        seconds, rate = (float(x) for x in phase.split(":"))
        t = start + rng.expovariate(rate)
        while t < start + seconds:
            out.append((t, [rng.randrange(100, 40000) for _ in range(plen())], olen()))
            t += rng.expovariate(rate)
        start += seconds
    return out


def serves(address: str) -> bool:
    try:
        Client(address, timeout=60).generate([5, 6, 7], max_tokens=2)
        return True
    except grpc.RpcError:
        return False


def sample_replicas(stop: threading.Event, samples: list) -> None:
    from ray import serve

    while not stop.is_set():
        deployments = serve.status().applications["pdserve"].deployments
        held = {p: sum(deployments[p].replica_states.get(s, 0) for s in HELD) for p in POOLS}
        samples.append((time.time(), held))
        stop.wait(1.0)


async def send(address: str, requests, timeout: float):
    opts = SimpleNamespace(temperature=0.0, ignore_eos=True)
    async with AsyncClient(address, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def at(when, prompt, max_tokens):
            await asyncio.sleep(max(0.0, when - (time.perf_counter() - t0)))
            return await one_request(client, {"prompt": prompt, "max_tokens": max_tokens}, t0, opts, None)

        records = await asyncio.gather(*(at(*r) for r in requests))
        return records, time.perf_counter() - t0


def run_policy(policy: str, base: dict, requests, args) -> dict:
    """On a fresh deployment: the trace's prompts are the same for every policy, and replicas
    kept from the previous run would hold them in their prefix caches."""
    from ray import serve

    if "pdserve" in serve.status().applications:
        serve.delete("pdserve")
    config = config_for(policy, base, args)
    serve_config.deploy(serve_config.validate(config))
    wait_running(["pdserve"], 900)
    direct = f"127.0.0.1:{config['applications'][0]['args']['router']['direct_port']}"
    wait_until(lambda: serves(direct), 600, "the router to discover both pools")
    wait_until(lambda: replica_counts() == {"Router": 1, "Prefill": 1, "Decode": 1}, 900, "one replica a pool")
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=sample_replicas, args=(stop, samples), daemon=True)
    sampler.start()
    try:
        records, duration = asyncio.run(send(direct, requests, args.timeout))
    finally:
        stop.set()
        sampler.join(timeout=30)
    rep = report(records, duration, args.slo_ttft, args.slo_tpot)
    replica_s = {p: 0.0 for p in POOLS}
    for (t, held), (t_next, _) in zip(samples, samples[1:]):
        for p in POOLS:
            replica_s[p] += held[p] * (t_next - t)
    good = rep.good_requests / len(records)
    most = max((h for _, h in samples), key=lambda h: sum(h.values()))
    print(
        f"{policy}: {rep.good_requests}/{len(records)} within the SLOs ({good:.0%}), errors {rep.errors}; "
        f"TTFT p50 {rep.ttft_s['p50']:.2f} s p95 {rep.ttft_s['p95']:.2f} s; TPOT p50 {rep.tpot_s['p50'] * 1e3:.0f} ms "
        f"p95 {rep.tpot_s['p95'] * 1e3:.0f} ms; replica-seconds Prefill {replica_s['Prefill']:.0f} "
        f"Decode {replica_s['Decode']:.0f}; most replicas {most}",
        flush=True,
    )
    return {
        "policy": policy,
        "slo_attainment": good,
        "replica_seconds": replica_s,
        "replica_seconds_total": sum(replica_s.values()),
        "replicas": [[round(t - samples[0][0], 1), h["Prefill"], h["Decode"]] for t, h in samples],
        "report": rep.to_dict(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=str(ROOT / "docs/bench/plan_profile.json"), help="from `pdserve plan profile`")
    ap.add_argument("--phases", default="60:0.05,150:0.4,120:0.05", help="SECONDS:RATE,... (requests/s, Poisson)")
    ap.add_argument("--prompt-len", default="uniform:590:630")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--slo-ttft", type=float, default=8.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.15, help="seconds per output token")
    ap.add_argument("--max-replicas", type=int, default=2, help="per pool")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="the planner's budget (its `cores`; 0: none)")
    ap.add_argument("--policies", default="threshold,planner")
    ap.add_argument("--timeout", type=float, default=600.0, help="a request's deadline (a guard against hangs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    requests = trace(args)
    print(f"trace: {len(requests)} requests over {args.phases}", flush=True)
    tmp = Path(f"/tmp/autoscale-trace-{time.time_ns()}")
    tmp.mkdir(mode=0o700)
    start_ray(tmp)
    # the shipped config on ports chosen once (Serve keeps its proxies' ports across deploys)
    results, base = [], default_model_config(min_replicas=1, max_replicas=args.max_replicas)
    try:
        for policy in args.policies.split(","):
            results.append(run_policy(policy, base, requests, args))
    finally:
        stop_ray()
        shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "trace": {k: getattr(args, k) for k in ("phases", "prompt_len", "output_len", "seed")}
        | {"requests": len(requests)},
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
        "max_replicas_per_pool": args.max_replicas,
        "planner_cores": args.cores,
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
