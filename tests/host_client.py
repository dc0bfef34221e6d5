"""What the two-host Ray tests and benchmark run inside a host's namespace (tests/ray_hosts.py):
each command prints its JSON answer on one line that begins with ANSWER (Ray may print warnings to
the same stdout, even after it).

    nodes ADDRESS                       the alive Ray nodes' IPs
    status ADDRESS                      replicas RUNNING per deployment, the registry's view, nodes
    loads ADDRESS                       each registered node's load: leases, blocks, running
    kill-router ADDRESS                 ray.kill one Router replica (as a crash), its actor name
    generate ROUTER PROMPTS MAX         greedy requests one by one: token ids and timings
    streams ROUTER PROMPTS MAX [APP]    the prompts as concurrent streams; per stream its
                                        messages' arrival times, tokens, and how it ended
                                        (APP: through Serve's proxy with metadata application=APP)
    load ROUTER PROMPT MAX CLIENTS STOP clients sending the prompt in a loop until the file STOP
                                        exists: requests done and every error
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc

ANSWER = "ANSWER "


def answer(stdout: str):
    """The JSON answer in a host_client run's stdout: its last line that begins with ANSWER."""
    lines = [line for line in stdout.splitlines() if line.startswith(ANSWER)]
    if not lines:
        raise AssertionError(f"host_client printed no answer line; its stdout ends: {stdout[-2000:]!r}")
    return json.loads(lines[-1][len(ANSWER) :])


def _ray(address: str):
    import ray

    ray.init(address=address, namespace="pdserve", log_to_driver=False, logging_level="ERROR")
    return ray


def nodes(address: str) -> list[str]:
    ray = _ray(address)
    return sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])


def status(address: str) -> dict:
    ray = _ray(address)
    from ray import serve

    from serving.registry import registry

    apps = serve.status().applications
    replicas = {}
    if "pdserve" in apps:
        replicas = {name: d.replica_states.get("RUNNING", 0) for name, d in apps["pdserve"].deployments.items()}
    try:
        view = ray.get(registry("pdserve").snapshot.remote(), timeout=30)
    except Exception as e:  # the registry restarting on another node
        view = {"settled": False, "router": [], "prefill": [], "decode": [], "error": str(e)}
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    return {"replicas": replicas, "registry": view, "nodes": alive}


def loads(address: str) -> dict:
    from google.protobuf.json_format import MessageToDict

    from pdserve_api import common_pb2, nodes_pb2_grpc

    ray = _ray(address)
    from serving.registry import registry

    view = ray.get(registry("pdserve").snapshot.remote(), timeout=30)
    out = {}
    for role, stub in (("prefill", nodes_pb2_grpc.PrefillNodeStub), ("decode", nodes_pb2_grpc.DecodeNodeStub)):
        for node in view[role]:
            with grpc.insecure_channel(node) as channel:
                load = stub(channel).GetLoad(common_pb2.LoadRequest(), timeout=30)
            keep = ("num_kv_leases", "num_running", "num_waiting", "num_free_blocks", "num_total_blocks")
            d = MessageToDict(load, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
            out[node] = {"role": role, **{k: d[k] for k in keep}}
    return out


def kill_router(address: str) -> str:
    ray = _ray(address)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Router#" in a["name"]]
    victim = sorted(names)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    return victim


def generate(router: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    from router.client import Client

    with Client(router, timeout=300) as c:
        out = []
        for p in prompts:
            r = c.generate(p, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            out.append({"ids": r.token_ids, "timings": r.timings})
        return out


async def _stream(client, prompt: list[int], max_tokens: int) -> dict:
    began, arrivals, tokens, timings = time.time(), [], [], {}
    try:
        async for part in client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
            arrivals.append(time.time())
            tokens.extend(part.token_ids)
            if part.finished:
                from google.protobuf.json_format import MessageToDict

                timings = MessageToDict(part.timings, preserving_proto_field_name=True)
        ended = "OK"
    except grpc.RpcError as e:
        arrivals.append(time.time())
        ended = f"{e.code().name}: {e.details()}"
    return {"began": began, "arrivals": arrivals, "tokens": tokens, "ended": ended, "timings": timings}


async def streams(router: str, prompts: list[list[int]], max_tokens: int, app: str | None) -> list[dict]:
    from router.client import AsyncClient

    metadata = [("application", app)] if app else None
    async with AsyncClient(router, metadata=metadata) as client:  # no deadline: a hang must show
        return list(await asyncio.gather(*(_stream(client, p, max_tokens) for p in prompts)))


async def load(router: str, prompt: list[int], max_tokens: int, clients: int, stop: str) -> dict:
    from pathlib import Path

    from router.client import AsyncClient

    done, errors = [0], []

    async def client_loop(client):
        while not Path(stop).exists():
            try:
                await client.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                done[0] += 1
            except grpc.RpcError as e:
                errors.append(f"{e.code().name}: {e.details()}")
                await asyncio.sleep(0.1)

    async with AsyncClient(router) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return {"done": done[0], "errors": errors}


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "nodes":
        result = nodes(args[0])
    elif command == "status":
        result = status(args[0])
    elif command == "loads":
        result = loads(args[0])
    elif command == "kill-router":
        result = kill_router(args[0])
    elif command == "generate":
        result = generate(args[0], json.loads(args[1]), int(args[2]))
    elif command == "streams":
        result = asyncio.run(streams(args[0], json.loads(args[1]), int(args[2]), args[3] if len(args) > 3 else None))
    elif command == "load":
        result = asyncio.run(load(args[0], json.loads(args[1]), int(args[2]), int(args[3]), args[4]))
    else:
        raise SystemExit(f"unknown command {command!r}")
    sys.stdout.write(f"\n{ANSWER}{json.dumps(result)}\n")  # one write: a line of its own
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
