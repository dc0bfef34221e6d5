"""pdserve on Ray Serve, measured: idle memory, the per-token cost of each ingress against
`pdserve up`, and how long each pool takes from load onset to a new replica serving.

    python benchmarks/ray_serve.py [--json FILE]

Starts a private local Ray cluster (2 CPUs, no dashboard), deploys deploy/serve_config.yaml with
the default model (`--dtype auto`; autoscaling min 1 / max 2, upscale delay 1 s; local prefill
off, in `pdserve up` too), and runs each
measurement in turn; `pdserve up` runs beside it for the comparison, with the same model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from ray_cluster import default_model_config, free_port, replica_counts, serves, wait_until  # noqa: E402

from pdserve import serve_config  # noqa: E402
from pdserve.ray_serve import wait_running  # noqa: E402
from router.client import AsyncClient, Client  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def ray_config() -> dict:
    config = default_model_config(
        min_replicas=1,
        max_replicas=2,
        upscale_delay_s=1,
        downscale_delay_s=600,
        metrics_interval_s=0.5,
        look_back_period_s=2,
    )
    for dep in config["applications"][0]["deployments"]:
        if "autoscaling_config" in dep:
            dep["autoscaling_config"]["policy"]["policy_kwargs"] = (
                {"target_pending_requests": 2} if dep["name"] == "Prefill" else {"target_running_sequences": 4}
            )
    # Every prefill on the prefill pool: with local prefill on, the router may run these 1,000-token
    # prompts on the idle decode node, where the threshold policy sees no prefill demand.
    config["applications"][0]["args"]["router"]["local_prefill"] = "off"
    return config


def ray_pss_mb(session_dir: str) -> float:
    """PSS of every process of this Ray session (head services, proxy, controller, replicas)."""
    total = 0
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if session_dir in cmd or "ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd:
                total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total / 1e6


def tpot(address: str, metadata=None, runs: int = 5, tokens: int = 64) -> float:
    """Median time per output token after the first, over `runs` streams."""
    client = Client(address, metadata=metadata)
    per_token = []
    for i in range(runs + 1):
        stamps, t = [], time.perf_counter()
        for part in client.stream(
            messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens, temperature=0, ignore_eos=True
        ):
            stamps.extend([time.perf_counter() - t] * len(part.token_ids))
        if i:
            per_token.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return statistics.median(per_token)


def pdserve_up_tpot() -> float:
    port = free_port()
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--port",
            str(port),
            "--num-threads",
            "1",
            "--kv-cache-gb",
            "0.25",
            "--local-prefill",
            "off",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in up.stderr:
            if line.startswith("pdserve up: router on"):
                break
        threading.Thread(target=up.stderr.read, daemon=True).start()
        return tpot(f"127.0.0.1:{port}")
    finally:
        up.terminate()
        up.wait(timeout=60)


def time_to_scale(address: str, pool: str, prompt, **params) -> float:
    """Seconds from load onset until `pool` has a second RUNNING replica that the router uses."""
    stop = threading.Event()

    async def worker():
        async with AsyncClient(address, timeout=120) as client:
            while not stop.is_set():
                await client.generate(prompt, **params)

    async def load():
        await asyncio.gather(*(worker() for _ in range(8)))

    onset = time.time()
    thread = threading.Thread(target=asyncio.run, args=(load(),), daemon=True)
    thread.start()
    try:
        wait_until(lambda: replica_counts()[pool] >= 2, 300, f"{pool} to scale up")
        return time.time() - onset
    finally:
        stop.set()
        thread.join(timeout=300)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    import ray
    from ray import serve

    results = {"pdserve_up_tpot_ms": pdserve_up_tpot() * 1e3}
    print(f"pdserve up TPOT: {results['pdserve_up_tpot_ms']:.2f} ms", flush=True)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from pdserve.ray_app import LOCAL_RESOURCES

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=f"/tmp/ray-bench-{os.getpid()}",
        log_to_driver=False,
        namespace="pdserve",
        resources=LOCAL_RESOURCES,
    )
    try:
        config = ray_config()
        serve_config.deploy(serve_config.validate(config))
        wait_running(["pdserve"], 600)
        direct = f"127.0.0.1:{config['applications'][0]['args']['router']['direct_port']}"
        proxy = f"127.0.0.1:{config['grpc_options']['port']}"
        wait_until(lambda: serves(direct), 600, "the router to find both pools")
        time.sleep(5)
        session = ray.get_runtime_context().gcs_address and ray._private.worker._global_node.get_session_dir_path()
        results["idle_pss_mb"] = ray_pss_mb(session)
        print(
            f"idle deployment (head + proxy + controller + router/prefill/decode replicas) PSS: "
            f"{results['idle_pss_mb']:.0f} MB",
            flush=True,
        )
        results["direct_tpot_ms"] = tpot(direct) * 1e3
        results["proxy_tpot_ms"] = tpot(proxy, metadata=[("application", "pdserve")]) * 1e3
        for k in ("direct", "proxy"):
            results[f"{k}_overhead_ms_per_token"] = results[f"{k}_tpot_ms"] - results["pdserve_up_tpot_ms"]
        print(
            f"TPOT: router replica's own port {results['direct_tpot_ms']:.2f} ms, Serve gRPC proxy "
            f"{results['proxy_tpot_ms']:.2f} ms (pdserve up {results['pdserve_up_tpot_ms']:.2f} ms)",
            flush=True,
        )
        long_prompt = [(i * 7919) % 40000 + 100 for i in range(1000)]
        results["prefill_scale_up_s"] = time_to_scale(direct, "Prefill", long_prompt, max_tokens=1)
        print(f"prefill: load onset -> second replica RUNNING: {results['prefill_scale_up_s']:.1f} s", flush=True)
        results["decode_scale_up_s"] = time_to_scale(direct, "Decode", "Hi", max_tokens=256, ignore_eos=True)
        print(f"decode: load onset -> second replica RUNNING: {results['decode_scale_up_s']:.1f} s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
