"""`pdserve serve`: deploy the application on a Ray cluster from a Serve config file."""

from __future__ import annotations

import signal
import sys
import threading
import time

from pdserve import serve_config


def wait_running(app_names: list[str], timeout_s: float) -> None:
    from ray import serve

    give_up = time.time() + timeout_s
    while True:
        apps = serve.status().applications
        states = {name: apps[name].status if name in apps else "NOT_STARTED" for name in app_names}
        if all(s == "RUNNING" for s in states.values()):
            return
        failed = {n: apps[n].message for n, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")}
        if failed:
            raise RuntimeError(f"deploy failed: {failed}")
        if time.time() > give_up:
            raise TimeoutError(f"applications not running after {timeout_s:.0f} s: {states}")
        time.sleep(1.0)


def serve(config_path: str | None, address: str | None, timeout_s: float = 600.0) -> int:
    import ray

    schema = serve_config.validate(serve_config.load(config_path or serve_config.DEFAULT_CONFIG))
    local = address is None
    if local:
        from pdserve.ray_app import LOCAL_RESOURCES

        ray.init(include_dashboard=True, dashboard_host="127.0.0.1", namespace="pdserve", resources=LOCAL_RESOURCES)
    else:
        ray.init(address=address, namespace="pdserve")
    try:
        serve_config.deploy(schema)
        wait_running([app.name for app in schema.applications], timeout_s)
        grpc_port = schema.grpc_options.port
        for app in schema.applications:
            direct = (app.args.get("router") or {}).get("direct_port", 50051)
            print(f"pdserve serve: application {app.name!r} is RUNNING\n"
                  f"  gRPC through Ray Serve's proxy: <node>:{grpc_port} with metadata application={app.name}\n"
                  f"    pdserve generate --addr 127.0.0.1:{grpc_port} --application {app.name} \"Hello\"\n"
                  f"  gRPC on the router replica's own port (no per-message proxy cost): <node>:{direct}\n"
                  f"    pdserve generate --addr 127.0.0.1:{direct} \"Hello\"", flush=True)
        if local:
            print("  Ray dashboard: http://127.0.0.1:8265 (Serve tab: deployments and replica counts)\n"
                  "Ctrl-C stops the application and the local Ray cluster.", flush=True)
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            stop.wait()
    except (ValueError, RuntimeError, TimeoutError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    finally:
        if local:
            from ray import serve as ray_serve

            ray_serve.shutdown()
            ray.shutdown()
    return 0
