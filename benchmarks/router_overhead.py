"""The router's own overhead: nodes that answer instantly, so all that is left is the router.

    python benchmarks/router_overhead.py [--json FILE]

A process serves an instant prefill node (first token at once, a lease descriptor) and an
instant decode node (streams the requested tokens at once, no transfer); the router runs as its
own process (`python -m router`). Measured from this process: the latency of a 2-token streaming
request through the router against the same two node calls made directly (the router's added
latency), and the requests/s the router sustains under 32 concurrent closed-loop clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import grpc

from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc
from router.client import AsyncClient
from serving.grpc_server import GrpcServer
from serving.launcher import ServerProcess

N = 2000  # requests per latency measurement


class InstantPrefill(nodes_pb2_grpc.PrefillNodeServicer):
    async def Prefill(self, request, context):
        now = time.time()
        return nodes_pb2.PrefillResponse(
            first_token_id=1,
            text="a",
            prefill_start=now,
            prefill_end=now,
            kv=nodes_pb2.KVSource(lease_id="x", num_tokens=len(request.prompt_token_ids)),
        )

    async def GetLoad(self, request, context):
        return common_pb2.NodeLoad()

    async def ReleaseKV(self, request, context):
        return nodes_pb2.ReleaseKVResponse(released=True)


class InstantDecode(nodes_pb2_grpc.DecodeNodeServicer):
    async def Decode(self, request, context):
        for i in range(request.sampling.max_tokens - 1):
            yield nodes_pb2.DecodeResponse(
                token_ids=[2], text="b", finished=i == request.sampling.max_tokens - 2, finish_reason="length"
            )

    async def GetLoad(self, request, context):
        return common_pb2.NodeLoad()


def serve_nodes(queue) -> None:
    async def run():
        prefill, decode = GrpcServer(), GrpcServer()
        prefill.add(
            nodes_pb2_grpc.add_PrefillNodeServicer_to_server,
            InstantPrefill(),
            nodes_pb2.DESCRIPTOR.services_by_name["PrefillNode"],
        )
        decode.add(
            nodes_pb2_grpc.add_DecodeNodeServicer_to_server,
            InstantDecode(),
            nodes_pb2.DESCRIPTOR.services_by_name["DecodeNode"],
        )
        await prefill.start()
        await decode.start()
        queue.put((prefill.address, decode.address))
        await asyncio.sleep(3600)

    asyncio.run(run())


async def direct_latency(prefill: str, decode: str) -> list[float]:
    async with grpc.aio.insecure_channel(prefill) as pc, grpc.aio.insecure_channel(decode) as dc:
        p, d = nodes_pb2_grpc.PrefillNodeStub(pc), nodes_pb2_grpc.DecodeNodeStub(dc)
        sampling = common_pb2.SamplingParams(max_tokens=2)
        times = []
        for _ in range(N):
            t = time.perf_counter()
            first = await p.Prefill(nodes_pb2.PrefillRequest(prompt_token_ids=[5, 6, 7], sampling=sampling))
            async for _ in d.Decode(
                nodes_pb2.DecodeRequest(
                    prompt_token_ids=[5, 6, 7], output_token_ids=[1], sampling=sampling, kv=first.kv
                )
            ):
                pass
            times.append(time.perf_counter() - t)
        return times


async def router_latency(router: str) -> list[float]:
    async with AsyncClient(router) as client:
        times = []
        for _ in range(N):
            t = time.perf_counter()
            await client.generate([5, 6, 7], max_tokens=2)
            times.append(time.perf_counter() - t)
        return times


async def router_rps(router: str, concurrency: int = 32, seconds: float = 10.0) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(client):
        nonlocal done
        while time.perf_counter() < stop:
            await client.generate([5, 6, 7], max_tokens=2)
            done += 1

    async with AsyncClient(router) as client:
        t = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return done / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    queue = multiprocessing.get_context("spawn").Queue()
    nodes = multiprocessing.get_context("spawn").Process(target=serve_nodes, args=(queue,), daemon=True)
    nodes.start()
    prefill, decode = queue.get(timeout=60)
    router = ServerProcess(["-m", "router", "--port", "0", "--prefill", prefill, "--decode", decode])
    try:
        address = router.wait_ready()
        direct = asyncio.run(direct_latency(prefill, decode))
        through = asyncio.run(router_latency(address))
        rps = asyncio.run(router_rps(address))
    finally:
        router.stop()
        nodes.terminate()
    result = {
        "direct_p50_ms": statistics.median(direct) * 1e3,
        "router_p50_ms": statistics.median(through) * 1e3,
        "router_p95_ms": sorted(through)[int(0.95 * len(through))] * 1e3,
        "router_rps": rps,
    }
    result["added_p50_ms"] = result["router_p50_ms"] - result["direct_p50_ms"]
    print(
        f"2-token request: direct to the nodes {result['direct_p50_ms']:.2f} ms p50, through the router "
        f"{result['router_p50_ms']:.2f} ms p50 ({result['router_p95_ms']:.2f} p95): the router adds "
        f"{result['added_p50_ms']:.2f} ms; it routes {rps:.0f} requests/s (32 concurrent clients)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
