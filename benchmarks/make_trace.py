"""Writes a bursty trace with shared system prompts in the Mooncake format (pdserve/trace.py).

    python benchmarks/make_trace.py [--seed 0] --out benchmarks/traces/bursty_shared.jsonl

Poisson arrivals in phases of (seconds, requests/s): quiet, a burst, quiet. Three in five
requests open with one of two system prompts of one 512-token block each (hash ids 0 and 1),
then 50-300 tokens of their own; the rest are 300-700 tokens of their own. Outputs are 16-64
tokens. No public trace can be fetched on this machine; this one has the published traces'
fields and block size, at a load two cores carry.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BLOCK = 512
PHASES = ((15.0, 0.2), (25.0, 1.0), (15.0, 0.2))


def rows(seed: int) -> list[dict]:
    rng, out, start, next_id = random.Random(seed), [], 0.0, 2
    for seconds, rate in PHASES:
        t = start + rng.expovariate(rate)
        while t < start + seconds:
            if rng.random() < 0.6:
                own = rng.randint(50, 300)
                ids = [rng.randrange(2)] + list(range(next_id, next_id + -(-own // BLOCK)))
                length = BLOCK + own
            else:
                length = rng.randint(300, 700)
                ids = list(range(next_id, next_id + -(-length // BLOCK)))
            next_id += len(ids)
            ms, output = round(t * 1000), rng.randint(16, 64)
            out.append({"timestamp": ms, "input_length": length, "output_length": output, "hash_ids": ids})
            t += rng.expovariate(rate)
        start += seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows(args.seed)))


if __name__ == "__main__":
    main()
