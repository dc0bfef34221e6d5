"""KV transfer between two hosts: a prefill node in one network namespace, the reader (the decode
side) in another, joined by a veth pair, with or without a tc rate limit. No shared memory.

    sudo .venv/bin/python benchmarks/kv_two_hosts.py [--tokens 4000] [--rates none,10gbit,25gbit] [--json FILE]

Per link: the prefill node leases the KV of a --tokens prompt; the reader pulls it --repeat times
with the tcp transport (1 and 2 connections) and the gRPC stream, and receives the same number of
bytes over a raw TCP socket from a plain sender in the prefill namespace (the baseline, same run).
Reported: medians, GB/s, and ratios to raw TCP and to the tc link rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # netns.py: two hosts on one machine
RATES_GBPS = {"10gbit": 1.25, "25gbit": 3.125}  # bytes per second / 1e9


def raw_sender(port: int, nbytes: int, repeat: int) -> None:
    """In the prefill namespace: sends nbytes `repeat` times to whoever connects."""
    payload = os.urandom(nbytes)  # real pages: bytes(n) maps the shared zero page, which copies from cache
    with socket.create_server(("0.0.0.0", port)) as server:
        print(f"READY 0.0.0.0:{port}", flush=True)
        conn, _ = server.accept()
        with conn:
            for _ in range(repeat):
                conn.sendall(payload)
                conn.recv(1)


def raw_receive(address: str, nbytes: int, repeat: int) -> list[float]:
    from kv_transfer import receive_repeatedly  # benchmarks/, this script's own folder

    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        return receive_repeatedly(s, nbytes, repeat)


async def reader(prefill: str, raw: str, tokens: int, repeat: int) -> dict:
    """In the decode namespace."""
    import grpc
    import torch

    from engine.kv_cache import KVCache
    from kvtransfer.grpc_stream import GrpcStreamReader
    from kvtransfer.layout import KVLayout
    from kvtransfer.tcp import TcpReader
    from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc

    prompt = [(i * 7919) % 40000 + 100 for i in range(tokens)]
    async with grpc.aio.insecure_channel(prefill) as channel:
        reply = await nodes_pb2_grpc.PrefillNodeStub(channel).Prefill(
            nodes_pb2.PrefillRequest(
                request_id="bench", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=2)
            )
        )
        source = reply.kv
        layout = KVLayout.from_proto(source.layout)
        kv = KVCache(
            layout.num_layers,
            len(source.block_ids) + 1,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
            getattr(torch, layout.dtype),
            torch.device("cpu"),
        )
        blocks = list(range(len(source.block_ids)))
        seconds = {}
        for name, r in (
            ("tcp_1", TcpReader(connections=1)),
            ("tcp_2", TcpReader(connections=2)),
            ("grpc", GrpcStreamReader()),
        ):
            await r.read(source, kv, layout, blocks)  # warm-up
            times = []
            for _ in range(repeat):
                t = time.perf_counter()
                await r.read(source, kv, layout, blocks)
                times.append(time.perf_counter() - t)
            seconds[name] = times
            await r.close()
        await nodes_pb2_grpc.PrefillNodeStub(channel).ReleaseKV(
            nodes_pb2.ReleaseKVRequest(lease_id=source.lease_id, access_key=source.access_key)
        )
    seconds["tcp_raw"] = raw_receive(raw, source.num_bytes, repeat)
    return {
        "num_bytes": source.num_bytes,
        "num_tokens": source.num_tokens,
        "dtype": layout.dtype,
        "gbps": {k: source.num_bytes / statistics.median(v) / 1e9 for k, v in seconds.items()},
        "seconds": seconds,
    }


def one_link(rate: str | None, args) -> dict:
    import subprocess

    from netns import in_namespace, two_hosts

    with two_hosts(rate) as (a, b, addr_a, addr_b):
        procs = []
        try:
            prefill = in_namespace(
                a,
                "-m",
                "prefill_node",
                "--host",
                addr_a,
                "--model",
                args.model,
                "--dtype",
                "auto",
                "--kv-cache-gb",
                "1",
                "--lease-ttl-s",
                "600",
            )
            procs.append(prefill)
            prefill_addr = prefill.wait_ready()
            # The raw sender needs the byte count: the reader reports it, so lease once to learn it.
            r = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    b,
                    sys.executable,
                    __file__,
                    "--size-of",
                    prefill_addr,
                    "--tokens",
                    str(args.tokens),
                ],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=600,
            )
            nbytes_probe = int(r.stdout.strip().splitlines()[-1])
            sender = in_namespace(a, __file__, "--raw-sender", "5201", str(nbytes_probe), str(args.repeat))
            procs.append(sender)
            sender.wait_ready()
            r = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    b,
                    sys.executable,
                    __file__,
                    "--reader",
                    prefill_addr,
                    "--raw",
                    f"{addr_a}:5201",
                    "--tokens",
                    str(args.tokens),
                    "--repeat",
                    str(args.repeat),
                ],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=900,
            )
            if r.returncode != 0:
                raise RuntimeError(r.stderr[-3000:])
            return json.loads(r.stdout.strip().splitlines()[-1])
        finally:
            for proc in reversed(procs):
                proc.stop()


async def size_of(prefill: str, tokens: int) -> int:
    import grpc

    from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc

    async with grpc.aio.insecure_channel(prefill) as channel:
        reply = await nodes_pb2_grpc.PrefillNodeStub(channel).Prefill(
            nodes_pb2.PrefillRequest(
                request_id="size",
                prompt_token_ids=[(i * 7919) % 40000 + 100 for i in range(tokens)],
                sampling=common_pb2.SamplingParams(max_tokens=2),
            )
        )
        await nodes_pb2_grpc.PrefillNodeStub(channel).ReleaseKV(
            nodes_pb2.ReleaseKVRequest(lease_id=reply.kv.lease_id, access_key=reply.kv.access_key)
        )
    return reply.kv.num_bytes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rates", default="none,10gbit,25gbit", help="tc rate limits of the veth link; none: unlimited")
    ap.add_argument("--json")
    ap.add_argument("--reader", help=argparse.SUPPRESS)
    ap.add_argument("--raw", help=argparse.SUPPRESS)
    ap.add_argument("--size-of", help=argparse.SUPPRESS)
    ap.add_argument("--raw-sender", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_sender:
        raw_sender(*args.raw_sender)
        return 0
    if args.size_of:
        print(asyncio.run(size_of(args.size_of, args.tokens)))
        return 0
    if args.reader:
        print(json.dumps(asyncio.run(reader(args.reader, args.raw, args.tokens, args.repeat))))
        return 0
    from netns import why_no_namespaces

    why = why_no_namespaces()
    if why:
        print(f"skipped: {why}")
        return 1
    results = {}
    for rate in args.rates.split(","):
        rate = None if rate == "none" else rate
        res = one_link(rate, args)
        g = res["gbps"]
        link = RATES_GBPS.get(rate)
        res["ratios"] = {k: g[k] / g["tcp_raw"] for k in ("tcp_1", "tcp_2", "grpc")}
        if link:
            res["of_link_rate"] = {k: g[k] / link for k in ("tcp_raw", "tcp_1", "tcp_2", "grpc")}
        results[rate or "unlimited"] = res
        print(
            f"{rate or 'unlimited':>10}: {res['num_bytes'] / 1e6:.1f} MB ({res['dtype']}); "
            + ", ".join(f"{k} {v:.2f} GB/s" for k, v in g.items())
            + "; / raw: "
            + ", ".join(f"{k} {v:.2f}" for k, v in res["ratios"].items())
            + ("; / link: " + ", ".join(f"{k} {v:.2f}" for k, v in res["of_link_rate"].items()) if link else ""),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
