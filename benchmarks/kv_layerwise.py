"""Layer-wise KV streaming across two hosts: how long the decode node waits after the prefill ends.

    sudo .venv/bin/python benchmarks/kv_layerwise.py [--tokens 4000] [--rate 10gbit] [--repeat 5] [--json FILE]

A prefill node in one network namespace, a decode node and the router in another, on a veth pair
under a tc rate limit (no shared memory between them). The same --tokens prompt goes through two
routers over the same nodes, alternately: kv_layerwise off (the KV moves over tcp after the
prefill) and on (each layer moves as soon as it is written). Per request, from the final timings:
    wait     = decode_admitted - prefill_end   (the prefill's end to the decode batch taking the sequence)
    transfer = transfer_end - transfer_start   (the KV read on the decode node)
    prefill  = prefill_end - prefill_start     (the prefill's compute, to see what streaming costs it)
Reported: medians, and the goal's ratio: wait with streaming / the unstreamed transfer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # netns.py: two hosts on one machine


async def drive(prefill: str, decode: str, model: str, tokens: int, repeat: int) -> dict:
    """In the decode namespace: two routers over the same nodes, requests alternating between them."""
    from router.client import AsyncClient
    from router.config import RouterConfig
    from router.server import Router

    prompt = [(i * 7919) % 40000 + 100 for i in range(tokens)]
    routers = {
        mode: Router(model, [prefill], [decode], RouterConfig(port=0, kv_layerwise=mode)) for mode in ("off", "on")
    }
    for r in routers.values():
        await r.start()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for i in range(repeat + 1):  # the first round warms up
            for mode, router in routers.items():
                async with AsyncClient(router.address) as client:
                    result = await client.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True)
                t = result.timings
                expected = "tcp-layerwise" if mode == "on" else "tcp"
                if t["kv_transport"] != expected:
                    raise RuntimeError(f"{mode}: the KV moved by {t['kv_transport']}, expected {expected}")
                if i:
                    runs[mode].append(
                        {
                            "wait": t["decode_admitted"] - t["prefill_end"],
                            "transfer": t["transfer_end"] - t["transfer_start"],
                            "prefill": t["prefill_end"] - t["prefill_start"],
                            "kv_bytes": int(t["kv_bytes"]),
                        }
                    )
    finally:
        for r in routers.values():
            await r.stop(0)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rate", default="10gbit", help="tc rate limit of the veth link; none: unlimited")
    ap.add_argument("--json")
    ap.add_argument("--drive", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        print(json.dumps(asyncio.run(drive(*args.drive, args.model, args.tokens, args.repeat))))
        return 0
    from netns import in_namespace, two_hosts, why_no_namespaces

    why = why_no_namespaces()
    if why:
        print(f"skipped: {why}")
        return 1
    rate = None if args.rate == "none" else args.rate
    with two_hosts(rate) as (a, b, addr_a, addr_b):
        # No prefix caching: each repeat of the same prompt is a full prefill and a full transfer.
        engine = ["--model", args.model, "--dtype", "auto", "--kv-cache-gb", "1", "--no-prefix-caching"]
        nodes = [
            in_namespace(a, "-m", "prefill_node", "--host", addr_a, *engine),
            in_namespace(b, "-m", "decode_node", "--host", addr_b, "--kv-transport", "tcp", *engine),
        ]
        try:
            prefill, decode = (n.wait_ready() for n in nodes)
            r = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    b,
                    sys.executable,
                    __file__,
                    "--drive",
                    prefill,
                    decode,
                    "--model",
                    args.model,
                    "--tokens",
                    str(args.tokens),
                    "--repeat",
                    str(args.repeat),
                ],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=1800,
            )
            if r.returncode != 0:
                raise RuntimeError(r.stderr[-6000:])
            runs = json.loads(r.stdout.strip().splitlines()[-1])
        finally:
            for n in reversed(nodes):
                n.stop()
    med = {
        mode: {k: statistics.median(run[k] for run in rs) for k in ("wait", "transfer", "prefill")}
        for mode, rs in runs.items()
    }
    result = {
        "tokens": args.tokens,
        "rate": args.rate,
        "kv_bytes": runs["off"][0]["kv_bytes"],
        "runs": runs,
        "median_s": med,
        "goal_ratio": med["on"]["wait"] / med["off"]["transfer"],
        "wait_ratio": med["on"]["wait"] / med["off"]["wait"],
        "prefill_ratio": med["on"]["prefill"] / med["off"]["prefill"],
    }
    print(f"{args.tokens} tokens, {result['kv_bytes'] / 1e6:.1f} MB of KV, link {args.rate}, medians of {args.repeat}:")
    for mode in ("off", "on"):
        m = med[mode]
        print(
            f"  layer-wise {mode:>3}: prefill end -> decode admitted {m['wait'] * 1e3:7.1f} ms, "
            f"KV read {m['transfer'] * 1e3:7.1f} ms, prefill {m['prefill'] * 1e3:7.1f} ms"
        )
    print(
        f"  streamed wait / unstreamed transfer = {result['goal_ratio']:.3f} (goal < 0.10); "
        f"streamed wait / unstreamed wait = {result['wait_ratio']:.3f}; "
        f"prefill on / off = {result['prefill_ratio']:.3f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
