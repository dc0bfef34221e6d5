"""pdserve on a Ray cluster of two hosts, measured (tests/ray_hosts.py: two network namespaces
joined by a veth pair, each a Ray node started with `ray start`, each with its own /dev/shm):

    python benchmarks/ray_two_hosts.py [--json FILE]     (root: it makes network namespaces)

1. The same workload (`pdserve bench`, closed loop) on one host (every replica on one Ray node:
   KV over shared memory) and on two (Prefill on A, Decode on B: KV over the TCP plane, layer
   by layer): TTFT and TPOT medians and their ratio.
2. Scale-up across hosts: a prefill-heavy load from one replica per pool to two Prefill replicas
   (on host A), then a decode-heavy one to two Decode replicas (on host B): seconds from load
   onset to the second replica RUNNING and announced.
3. The decode host lost: one Decode replica on each host, streams on both, host B's Ray node
   killed (SIGKILL to every process in its namespace). Per stream: how it ended, whether it
   migrated (its final timings count migrations), the longest gap between two of its messages
   after the kill (a migrated stream's gap is its re-prefill on the surviving host; the streams
   already there wait for those prefills too), tokens equal to the engine alone (fp32); then the
   leases and KV blocks left on the surviving nodes.

Default model, dtype float32 (exact: equality holds in fp32), one torch thread per engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import yaml  # noqa: E402
from host_client import answer  # noqa: E402
from ray_hosts import ray_two_hosts  # noqa: E402
from ray_serve import ray_config  # noqa: E402 (benchmarks/, this script's own folder)

MODEL = "smollm2-135m"
SPLIT = ({"pdserve_router": 4, "pdserve_prefill": 16}, {"pdserve_decode": 16})
ONE_HOST = ({"pdserve_router": 4, "pdserve_prefill": 16, "pdserve_decode": 16}, None)
DECODE_ON_BOTH = ({"pdserve_router": 4, "pdserve_prefill": 16, "pdserve_decode": 1}, {"pdserve_decode": 1})


def config(path: Path, decode_replicas: int | None = None) -> str:
    """benchmarks/ray_serve.py's config (the default model, one torch thread and 256 MiB of KV per
    engine, autoscaling min 1 / max 2 with a 1 s upscale delay) in fp32; or a fixed number of
    Decode replicas."""
    c = ray_config()
    app = c["applications"][0]
    app["args"]["model"] = MODEL
    for pool in ("prefill", "decode"):
        app["args"][pool]["engine"]["dtype"] = "float32"
    for dep in app["deployments"]:
        if dep["name"] == "Decode" and decode_replicas:
            del dep["autoscaling_config"]
            dep["num_replicas"] = decode_replicas
    path.write_text(yaml.safe_dump(c))
    return str(path)


def deploy(c, path: str) -> list[str]:
    """`pdserve serve --address` from host A; the routers' own addresses."""
    t = time.time()
    c.run(c.a, "-m", "pdserve", "serve", "--config", path, "--address", c.address)
    print(f"deployed in {time.time() - t:.0f} s", flush=True)
    return c.wait_until(lambda s: s["registry"].get("router") and s["registry"]["decode"], "the app")["registry"]


def same_workload(tmp: Path, layout, label: str) -> dict:
    with ray_two_hosts(*layout) as c:
        view = deploy(c, config(tmp / f"{label}.yaml"))
        router = view["router"][0]
        probe = c.client("generate", router, json.dumps([[1, 2, 3, 4, 5] * 40]), "8")[0]["timings"]
        out = tmp / f"bench-{label}.json"
        c.run(
            c.a,
            "-m",
            "pdserve",
            "bench",
            "--addr",
            router,
            "--num-requests",
            "32",
            "--concurrency",
            "4",
            "--prompt-len",
            "uniform:200:400",
            "--output-len",
            "64",
            "--seed",
            "7",
            "--quiet",
            "--json",
            str(out),
            timeout=1800,
        )
        rep = json.loads(out.read_text())["runs"][0]["report"]
        return {
            "placement": view,
            "kv_transport": probe["kv_transport"],
            "completed": rep["completed"],
            "num_requests": rep["num_requests"],
            "ttft_p50_ms": rep["ttft_s"]["p50"] * 1e3,
            "tpot_p50_ms": rep["tpot_s"]["p50"] * 1e3,
            "tps": rep["tps"],
        }


def _time_to_grow(c, tmp: Path, pool: str, prompt: list[int], max_tokens: int, clients: int) -> float:
    stop, router = tmp / f"stop-{pool}", c.status()["registry"]["router"][0]
    began = time.time()
    load = c.spawn(c.b, "tests/host_client.py", "load", router, json.dumps(prompt), str(max_tokens), str(clients),
                   str(stop))  # fmt: skip
    try:
        role = pool.lower()
        grown = lambda s: s["replicas"].get(pool, 0) >= 2 and len(s["registry"].get(role, [])) >= 2  # noqa: E731
        c.wait_until(grown, f"{pool} x2", 900)
        return time.time() - began
    finally:
        stop.touch()
        load.communicate(timeout=900)


def scale_up(tmp: Path) -> dict:
    with ray_two_hosts(*SPLIT) as c:
        deploy(c, config(tmp / "scale.yaml"))
        prefill_s = _time_to_grow(c, tmp, "Prefill", [(i * 37) % 4000 + 10 for i in range(1000)], 1, 8)
        decode_s = _time_to_grow(c, tmp, "Decode", [5, 6, 7, 8, 9, 10, 11, 12], 256, 8)
        view = c.status()
        return {
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "prefill_on_host_a": all(a.startswith(c.ip_a + ":") for a in view["registry"]["prefill"]),
            "decode_on_host_b": all(a.startswith(c.ip_b + ":") for a in view["registry"]["decode"]),
            "replicas": view["replicas"],
        }


def decode_host_lost(tmp: Path, streams: int = 8, max_tokens: int = 256) -> dict:
    from conftest import make_engine, run_to_completion  # the tests' engine helpers

    from engine import SamplingParams
    from engine.model_source import resolve_model

    prompts = [[(i * 131 + j * 17) % 4000 + 50 for j in range(100 + 20 * i)] for i in range(streams)]
    engine = make_engine(resolve_model(MODEL), num_kv_blocks=1024, block_size=16)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine)
    expected = [outs[str(i)].token_ids for i in range(streams)]
    with ray_two_hosts(*DECODE_ON_BOTH) as c:
        view = deploy(c, config(tmp / "lost.yaml", decode_replicas=2))
        c.wait_until(lambda s: len(s["registry"]["decode"]) == 2, "a decode replica on each host")
        router = view["router"][0]
        _wait_router_uses(c, router, 2)
        proc = c.spawn(c.a, "tests/host_client.py", "streams", router, json.dumps(prompts), str(max_tokens))
        time.sleep(4.0)
        killed_at = time.time()
        c.hosts[1].kill()
        out, err = proc.communicate(timeout=1800)
        records = answer(out)
        time.sleep(5)
        left = c.client("loads", c.address)
        per_stream = []
        for r, want in zip(records, expected):
            gaps = [b - a for a, b in zip([r["began"]] + r["arrivals"], r["arrivals"])]
            after = [b - a for a, b in zip([r["began"]] + r["arrivals"], r["arrivals"]) if b >= killed_at]
            per_stream.append(
                {
                    "ended": r["ended"],
                    "tokens": len(r["tokens"]),
                    "equal_to_engine": r["tokens"] == want,
                    "decode_node": r["timings"].get("decode_node", ""),
                    "migrations": int(r["timings"].get("migrations", 0)),
                    "max_gap_s": max(gaps),
                    "gap_after_kill_s": max(after) if after else 0.0,
                    "done_after_kill_s": r["arrivals"][-1] - killed_at,
                }
            )
        on_b = [s for s in per_stream if s["migrations"]]  # the streams host B carried
        stayed = [s for s in per_stream if not s["migrations"]]
        return {
            "streams": per_stream,
            "completed": sum(s["ended"] == "OK" for s in per_stream),
            "failed": sum(s["ended"] != "OK" for s in per_stream),
            "wrong_tokens": sum(s["ended"] == "OK" and not s["equal_to_engine"] for s in per_stream),
            "migrated": len(on_b),
            "gap_s_median": statistics.median(s["gap_after_kill_s"] for s in on_b) if on_b else None,
            "gap_s_max": max(s["gap_after_kill_s"] for s in on_b) if on_b else None,
            # the streams on host A wait too: the survivor re-prefills the migrated ones
            "gap_s_median_on_survivor": statistics.median(s["gap_after_kill_s"] for s in stayed) if stayed else None,
            "leases_left": sum(v["num_kv_leases"] for v in left.values()),
            "blocks_left": sum(v["num_total_blocks"] - v["num_free_blocks"] for v in left.values()),
            "surviving_nodes": left,
        }


def _wait_router_uses(c, router: str, n: int, timeout_s: float = 300) -> None:
    """Until the router spreads requests over n decode nodes (it finds new replicas in the
    registry, then health-checks them): two probes in a row land on different ones."""
    began = time.time()
    while time.time() < began + timeout_s:
        probes = c.client("generate", router, json.dumps([[3, 1, 4, 1, 5]] * n), "2")
        if len({p["timings"]["decode_node"] for p in probes}) == n:
            return
        time.sleep(2)
    raise TimeoutError(f"the router did not use {n} decode nodes in {timeout_s} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--phases", default="workload,scale,lost", help="comma-separated: workload, scale, lost")
    args = ap.parse_args()
    from engine.model_source import resolve_model

    resolve_model(MODEL)  # converted once, before any replica reads the cache
    results: dict = {"date": time.strftime("%Y-%m-%d"), "model": MODEL, "dtype": "float32"}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        phases = args.phases.split(",")
        if "workload" in phases:
            one = same_workload(tmp, ONE_HOST, "one-host")
            two = same_workload(tmp, SPLIT, "two-hosts")
            results["workload"] = {
                "one_host": one,
                "two_hosts": two,
                "ttft_ratio": two["ttft_p50_ms"] / one["ttft_p50_ms"],
                "tpot_ratio": two["tpot_p50_ms"] / one["tpot_p50_ms"],
            }
            print(json.dumps(results["workload"], indent=1), flush=True)
        if "scale" in phases:
            results["scale_up"] = scale_up(tmp)
            print(json.dumps(results["scale_up"], indent=1), flush=True)
        if "lost" in phases:
            results["decode_host_lost"] = decode_host_lost(tmp)
            print(json.dumps({k: v for k, v in results["decode_host_lost"].items() if k != "streams"}, indent=1))
    if args.json:  # a run of some phases keeps the others' results
        path = Path(args.json)
        earlier = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**earlier, **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
