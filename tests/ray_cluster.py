"""A private local Ray cluster for the Ray tests, and a Serve config pointed at the tiny model."""

from __future__ import annotations

import copy
import glob
import os
import shutil
import socket
import time

import grpc

from pdserve import serve_config
from router.client import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(model, **autoscaling) -> dict:
    """deploy/serve_config.yaml, on the tiny model, free ports, small engines and quick scaling."""
    config = copy.deepcopy(serve_config.load())
    config["http_options"]["port"] = free_port()
    config["grpc_options"]["port"] = free_port()
    app = config["applications"][0]
    engine = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 512, "block_size": 4, "num_threads": 1}
    app["args"].update(model=str(model))
    app["args"]["router"]["direct_port"] = free_port()
    app["args"]["router"]["local_prefill"] = "off"  # these tests follow the KV between the pools
    app["args"]["prefill"]["engine"] = dict(engine)
    app["args"]["decode"]["engine"] = dict(engine)
    for dep in app["deployments"]:
        if "autoscaling_config" in dep:
            # Down only after 30 s below target: on two busy cores a replica takes minutes to start,
            # and a 2 s dip in the signal stopped each STARTING replica before it ran (seen: eight
            # up/down flaps in five minutes, no second replica).
            dep["autoscaling_config"].update(
                min_replicas=1,
                max_replicas=2,
                metrics_interval_s=0.5,
                look_back_period_s=2,
                upscale_delay_s=1,
                downscale_delay_s=30,
                **autoscaling,
            )
            dep["graceful_shutdown_timeout_s"] = 60
            # Thresholds a 12-client test load crosses: prefill at 4 pending requests per
            # replica, decode at 4 running sequences per replica.
            kwargs = dep["autoscaling_config"]["policy"]["policy_kwargs"]
            kwargs.update(
                {"Prefill": {"target_pending_requests": 4}, "Decode": {"target_running_sequences": 4}}[dep["name"]]
            )
    return config


def default_model_config(**autoscaling) -> dict:
    """deploy/serve_config.yaml on the default model, free ports, one-thread engines of 256 MiB of
    KV, each deployment's autoscaling_config updated with `autoscaling` (the benchmarks' setup)."""
    config = serve_config.load()
    config["http_options"]["port"] = free_port()
    config["grpc_options"]["port"] = free_port()
    app = config["applications"][0]
    app["args"]["router"]["direct_port"] = free_port()
    for pool in ("prefill", "decode"):
        app["args"][pool]["engine"].update(num_threads=1, kv_cache_bytes=256 << 20)
    for dep in app["deployments"]:
        if "autoscaling_config" in dep:
            dep["autoscaling_config"].update(autoscaling)
    return config


def start_ray(tmp_path, attempts: int = 3) -> None:
    """Start a private local cluster. On a loaded machine a raylet can miss Ray's fixed 30 s
    registration window ("The current node timed out during startup"); then the processes that
    attempt started are stopped by PID, their logs' tails printed, and a fresh cluster tried."""
    import psutil
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    from pdserve.ray_app import LOCAL_RESOURCES

    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {c.pid for c in me.children(recursive=True)}
        # A short socket path: the default temp dir under pytest's tmp_path can exceed AF_UNIX limits.
        temp_dir = f"/tmp/ray-{os.getpid()}-{attempt}"
        try:
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                _temp_dir=temp_dir,
                namespace="pdserve",
                log_to_driver=False,
                resources=LOCAL_RESOURCES,
            )
            return
        except Exception as e:
            ray.shutdown()
            started = [c for c in me.children(recursive=True) if c.pid not in before]
            for child in started:
                child.kill()
            psutil.wait_procs(started, timeout=10)
            print(f"ray.init attempt {attempt} failed: {e}")
            _print_log_tails(temp_dir)
            if attempt == attempts:
                raise


def _print_log_tails(temp_dir: str, lines: int = 20) -> None:
    from pathlib import Path

    for log in sorted(Path(temp_dir).glob("session_2*/logs/*")):
        if log.name.startswith(("raylet", "gcs_server")) and log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- {log} (last {len(tail)} lines)", *tail, sep="\n")


def stop_ray() -> None:
    """Stops Serve and the cluster, and removes the temporary directories start_ray gave it."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    for temp_dir in glob.glob(f"/tmp/ray-{os.getpid()}-*"):
        shutil.rmtree(temp_dir, ignore_errors=True)


def replica_counts(app: str = "pdserve") -> dict[str, int]:
    from ray import serve

    deployments = serve.status().applications[app].deployments
    return {name: d.replica_states.get("RUNNING", 0) for name, d in deployments.items()}


# How long a wait for Ray or Serve may take before it is called a hang: a guard, not a speed check.
# Starting a replica on two cores that other processes keep busy took minutes (a Python worker
# importing torch and Ray, then the engine), so the guards are long; each wait prints its time.
HANG_S = 600.0


def serves(address: str, prompt: str | list[int] = "hi") -> bool:
    """Whether the router at address answers a request end to end (it has found both pools)."""
    try:
        Client(address, timeout=10).generate(prompt, max_tokens=2)
        return True
    except grpc.RpcError:
        return False


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.5, last=None):
    """Polls until predicate() is truthy; on a timeout the error names `what` and, when given,
    last() (e.g. the replica counts seen last)."""
    began = time.time()
    while time.time() < began + timeout_s:
        result = predicate()
        if result:
            print(f"waited {time.time() - began:.1f} s for {what}")
            return result
        time.sleep(interval_s)
    raise AssertionError(
        f"timed out after {timeout_s} s waiting for {what}" + (f"; last seen: {last()}" if last is not None else "")
    )
