"""What naming and checking prefix-cache blocks costs, per prompt (engine/block_manager.py).

    .venv/bin/python benchmarks/prefix_hash.py [--tokens 1000] [--block-size 16] [--json FILE]

Times, for one prompt of --tokens tokens (medians of 200 after a warm-up): its block names with
xxh3-64 (what the engine and the routers use) and, for comparison, with SHA-256 over the same
bytes (what vLLM moved to after CVE-2025-25183); and a full prefix-cache hit through
BlockManager.acquire_prefix, which checks each hit's key (parent block and generation, tokens).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.block_manager import BlockManager, block_hashes  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sequence import Sequence  # noqa: E402


def sha256_hashes(token_ids: list[int], block_size: int) -> list[int]:
    parent, names = 0, []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        data = struct.pack(f"<Q{block_size}q", parent, *token_ids[start : start + block_size])
        parent = int.from_bytes(hashlib.sha256(data).digest()[:8], "little")
        names.append(parent)
    return names


def median_us(fn, repeat: int = 200) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.tokens)]
    bm = BlockManager(4 * args.tokens // args.block_size + 8, args.block_size)
    first = Sequence("a", list(prompt), SamplingParams(max_tokens=1))
    bm.allocate(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    bm.cache_computed_blocks(first)

    def hit():
        seq = Sequence("b", list(prompt), SamplingParams(max_tokens=1))
        found = bm.acquire_prefix(seq)
        bm.free(seq)
        return found

    assert hit() == (len(prompt) - 1) // args.block_size * args.block_size
    result = {
        "tokens": args.tokens,
        "block_size": args.block_size,
        "xxh3_names_us": median_us(lambda: block_hashes(prompt, args.block_size)),
        "sha256_names_us": median_us(lambda: sha256_hashes(prompt, args.block_size)),
        "checked_hit_us": median_us(hit),
    }
    result["sha256_over_xxh3"] = result["sha256_names_us"] / result["xxh3_names_us"]
    print(
        f"{args.tokens}-token prompt, blocks of {args.block_size}, medians of 200: names xxh3 "
        f"{result['xxh3_names_us']:.0f} us, SHA-256 {result['sha256_names_us']:.0f} us "
        f"({result['sha256_over_xxh3']:.2f}x); a full cache hit, names and every key checked: "
        f"{result['checked_hit_us']:.0f} us"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
