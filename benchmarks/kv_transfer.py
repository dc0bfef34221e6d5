"""KV transfer bandwidth, and what the transfer adds to a request's latency.

    .venv/bin/python benchmarks/kv_transfer.py [--tokens 1000] [--repeat 10] [--json FILE]

Starts a real prefill node process (default model, dtype auto), prefills a prompt of --tokens tokens
and keeps its KV under a lease; then, in this process (the decode side), reads that KV --repeat
times with each transport (shm, tcp, grpc) into a decode-side KV cache, and measures in the same
run a plain in-process copy of the same number of bytes and a raw TCP loopback socket between two
processes (tcp_raw): the baselines of the ratios (shm / copy; tcp and grpc / tcp_raw).
Then it starts a decode node process and a router and measures, for the same prompt, TTFT and
the time to the second token through the cluster against the prefill compute alone.
Reported: medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_cache import KVCache
from engine.model_source import resolve_model
from kvtransfer.grpc_stream import GrpcStreamReader
from kvtransfer.layout import KVLayout, aligned_runs, model_fingerprint
from kvtransfer.shm import ShmReader
from kvtransfer.tcp import DEFAULT_CONNECTIONS, TcpReader
from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc
from serving.launcher import ServerProcess
from serving.options import HelpFormatter

# No prefix caching: the same prompt is sent again and again, and each time must be the full prefill.
NODE_ARGS = ["--dtype", "auto", "--kv-cache-gb", "0.25", "--block-size", "16", "--no-prefix-caching"]


def start_node(module: str, *extra: str) -> tuple[ServerProcess, str]:
    node = ServerProcess(["-m", module, "--port", "0", *NODE_ARGS, *extra])
    return node, node.wait_ready()


def median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _tcp_sender(port: int, nbytes: int, repeat: int) -> None:
    payload = os.urandom(nbytes)  # real pages: bytes(n) maps the shared zero page, which copies from cache
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(repeat):
            s.recv(1)  # go
            s.sendall(payload)


@contextlib.contextmanager
def raw_tcp(nbytes: int, repeat: int):
    """A raw TCP loopback socket to a sender process; yields receive() -> the seconds from asking
    for nbytes to having them in a preallocated buffer (the baseline of the tcp transport)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        sender = multiprocessing.get_context("spawn").Process(
            target=_tcp_sender, args=(server.getsockname()[1], nbytes, repeat)
        )
        sender.start()
        conn, _ = server.accept()
        buf = memoryview(bytearray(nbytes))

        def receive() -> float:
            got, t = 0, time.perf_counter()
            conn.sendall(b"g")
            while got < nbytes:
                got += conn.recv_into(buf[got:], nbytes - got)
            return time.perf_counter() - t

        try:
            with conn:
                yield receive
        finally:
            sender.join(timeout=10)
            if sender.is_alive():
                sender.kill()


def receive_repeatedly(conn: socket.socket, nbytes: int, repeat: int) -> list[float]:
    """Receives nbytes `repeat` times into one preallocated buffer, acknowledging each; the seconds."""
    buf = memoryview(bytearray(nbytes))
    times = []
    for _ in range(repeat):
        got, t = 0, time.perf_counter()
        while got < nbytes:
            got += conn.recv_into(buf[got:], nbytes - got)
        times.append(time.perf_counter() - t)
        conn.sendall(b"k")
    return times


async def bench_reader(reader, source, kv_cache: KVCache, layout: KVLayout, repeat: int) -> list[float]:
    blocks = list(range(len(source.block_ids)))
    await reader.read(source, kv_cache, layout, blocks)  # warm-up: maps the region / opens the channel
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        await reader.read(source, kv_cache, layout, blocks)
        times.append(time.perf_counter() - t)
    return times


def prefill_alone(model_dir, prompt: list[int], repeat: int) -> list[float]:
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="auto", kv_cache_bytes=256 << 20, enable_prefix_caching=False)
    )  # each repeat computes the whole prompt
    times = []
    for i in range(repeat + 1):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, temperature=0))
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t)
    return times[1:]


async def bench_cluster(prefill_addr: str, decode_addr: str, model: str, prompt: list[int], repeat: int) -> dict:
    from router.client import AsyncClient
    from router.config import RouterConfig
    from router.server import Router

    router = Router(
        model, [prefill_addr], [decode_addr], RouterConfig(port=0, local_prefill="off")
    )  # the KV always crosses
    await router.start()
    ttft, second, transfer, prefill, kv_transport = [], [], [], [], set()
    try:
        async with AsyncClient(router.address) as client:
            for i in range(repeat + 1):
                t = time.perf_counter()
                stamps, last = [], None
                async for part in client.stream(prompt, max_tokens=2, temperature=0, ignore_eos=True):
                    stamps.append(time.perf_counter() - t)
                    last = part
                if i == 0:
                    continue  # warm-up
                ttft.append(stamps[0])
                second.append(stamps[1])
                transfer.append(last.timings.transfer_end - last.timings.transfer_start)
                prefill.append(last.timings.prefill_end - last.timings.prefill_start)
                kv_transport.add(last.timings.kv_transport)
    finally:
        await router.stop(0)
    if "" in kv_transport:
        raise RuntimeError("a request was prefilled on the decode node: no KV transfer to measure")
    return {
        "ttft_s": statistics.median(ttft),
        "second_token_s": statistics.median(second),
        "transfer_s": statistics.median(transfer),
        "prefill_on_node_s": statistics.median(prefill),
        "kv_transport": sorted(kv_transport),
    }


async def bench_transports(args, prefill_addr: str, model_dir, prompt: list[int]) -> dict:
    channel = grpc.aio.insecure_channel(prefill_addr)
    reply = await nodes_pb2_grpc.PrefillNodeStub(channel).Prefill(
        nodes_pb2.PrefillRequest(
            request_id="bench", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0)
        )
    )
    source = reply.kv
    layout = KVLayout.from_proto(source.layout)
    layout.check(
        KVLayout(
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            layout.dtype,
            layout.block_size,
            model_fingerprint(model_dir),
        )
    )
    kv_cache = KVCache(
        layout.num_layers,
        len(source.block_ids) + 4,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
        getattr(torch, layout.dtype),
        torch.device("cpu"),
    )
    results = {"num_tokens": source.num_tokens, "num_bytes": source.num_bytes}
    grpc_reader = GrpcStreamReader()
    shm_reader = ShmReader()
    # The one-sided read, verified as decode nodes run it and bytes alone, interleaved with its
    # baseline (an in-process copy of as many bytes), so that drift on a shared machine hits all three.
    blocks = list(range(len(source.block_ids)))
    await shm_reader.read(source, kv_cache, layout, blocks)  # warm-up: maps the region
    region = shm_reader._attach(source, layout)
    runs = aligned_runs(list(source.block_ids), blocks)
    src = torch.ones(source.num_bytes, dtype=torch.uint8)
    dst = torch.zeros(source.num_bytes, dtype=torch.uint8)
    for name in ("copy_s", "shm_s", "shm_bytes_s"):
        results[name] = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        dst.copy_(src)
        results["copy_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await shm_reader.read(source, kv_cache, layout, blocks)
        results["shm_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for s, d, n in runs:
            kv_cache.kv[:, :, d : d + n].copy_(region[:, :, s : s + n])
        results["shm_bytes_s"].append(time.perf_counter() - t)
    # The tcp transport interleaved with its baseline, raw TCP loopback to another process.
    tcp_reader = TcpReader(connections=args.connections)
    await tcp_reader.read(source, kv_cache, layout, blocks)  # warm-up
    results["tcp_s"], results["tcp_raw_s"] = [], []
    with raw_tcp(source.num_bytes, args.repeat + 1) as receive:
        receive()  # warm-up
        for _ in range(args.repeat):
            results["tcp_raw_s"].append(receive())
            t = time.perf_counter()
            await tcp_reader.read(source, kv_cache, layout, blocks)
            results["tcp_s"].append(time.perf_counter() - t)
    results["grpc_s"] = await bench_reader(grpc_reader, source, kv_cache, layout, args.repeat)
    await grpc_reader.close()
    await nodes_pb2_grpc.PrefillNodeStub(channel).ReleaseKV(
        nodes_pb2.ReleaseKVRequest(lease_id=source.lease_id, access_key=source.access_key)
    )
    await channel.close()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/kv_transfer.py", formatter_class=HelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="whose KV to move")
    ap.add_argument("--tokens", type=int, default=1000, help="prompt length: the KV of this many tokens moves")
    ap.add_argument("--repeat", type=int, default=10, help="reads per transport (the median is reported)")
    ap.add_argument(
        "--connections", type=int, default=DEFAULT_CONNECTIONS, help="parallel connections of the tcp transport"
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.tokens)]
    prefill_proc, prefill_addr = start_node("prefill_node", "--model", args.model, "--lease-ttl-s", "600")
    decode_proc = None
    try:
        r = asyncio.run(bench_transports(args, prefill_addr, model_dir, prompt))
        nbytes = r["num_bytes"]
        names = ("copy", "shm_bytes", "shm", "tcp_raw", "tcp", "grpc")
        gbps = {k: median_gbps(nbytes, r[k + "_s"]) for k in names}
        print(f"KV of a {r['num_tokens']}-token prompt: {nbytes / 1e6:.1f} MB; median of {args.repeat} reads")
        for name, label in [
            ("copy", "in-process tensor copy"),
            ("shm_bytes", "shm one-sided read, bytes only"),
            ("shm", "shm one-sided read + integrity check"),
            ("tcp_raw", "raw TCP loopback"),
            ("tcp", f"tcp data plane, {args.connections} conn. (+ digest)"),
            ("grpc", "gRPC stream, 1 MiB chunks (+ digests)"),
        ]:
            print(f"  {label:>38}: {gbps[name]:6.2f} GB/s")
        print(
            f"  shm / copy: bytes {gbps['shm_bytes'] / gbps['copy']:.2f}, verified {gbps['shm'] / gbps['copy']:.2f} "
            f"(goal >= 0.60); tcp / tcp_raw: {gbps['tcp'] / gbps['tcp_raw']:.2f} (goal >= 0.80); "
            f"grpc / tcp_raw: {gbps['grpc'] / gbps['tcp_raw']:.2f}"
        )
        decode_proc, decode_addr = start_node("decode_node", "--model", args.model)
        cluster = asyncio.run(bench_cluster(prefill_addr, decode_addr, args.model, prompt, args.repeat))
    finally:
        for proc in (prefill_proc, decode_proc):
            if proc is not None:
                proc.stop()
    alone = statistics.median(prefill_alone(model_dir, prompt, args.repeat))
    print(
        f"TTFT through the cluster {cluster['ttft_s'] * 1e3:.1f} ms vs prefill compute alone {alone * 1e3:.1f} ms "
        f"({cluster['ttft_s'] / alone - 1:+.1%}); KV transfer ({'/'.join(cluster['kv_transport'])}) "
        f"{cluster['transfer_s'] * 1e3:.1f} ms; second token at {cluster['second_token_s'] * 1e3:.1f} ms"
    )
    baseline = {"copy": "copy", "shm_bytes": "copy", "shm": "copy", "tcp_raw": "tcp", "tcp": "tcp", "grpc": "tcp"}
    transports = {
        name: {
            "gbps": gbps[name],
            "baseline": baseline[name],
            "ratio": gbps[name] / gbps["copy" if baseline[name] == "copy" else "tcp_raw"],
        }
        for name in ("copy", "tcp_raw", "shm", "tcp", "grpc")
    }
    result = {
        "transports": transports,
        "ttft_ms": {
            "cluster": cluster["ttft_s"] * 1e3,
            "prefill_alone": alone * 1e3,
            "transfer": cluster["transfer_s"] * 1e3,
            "second_token": cluster["second_token_s"] * 1e3,
        },
        "gbps": gbps,
        "num_bytes": nbytes,
        "num_tokens": r["num_tokens"],
        "cluster": cluster,
        "tcp_connections": args.connections,
        "prefill_alone_s": alone,
        "raw_seconds": {k + "_s": r[k + "_s"] for k in names},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
