"""Faults injected, and what happened to every request: docs/reliability.md's table.

    python benchmarks/reliability.py [--json FILE]

Node processes (tiny random model, so the run takes a minute) are killed by PID at each step of a
request's life; then a soak with random cancellations. Same scenarios as tests/test_faults.py,
with more requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from chaos import decode_dies, prefill_dies, prefill_gone_before, soak, transfer_fails  # noqa: E402
from cluster import local_cluster, wait_for_no_blocks  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

MAX_TOKENS = 80


def expected_tokens(model, prompts) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu", num_kv_blocks=1024, block_size=4))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[str(i)] for i in range(len(prompts))]


async def soak_run(model):
    async with local_cluster(
        model, num_prefill=1, num_decode=2, lease_ttl_s=2.0, decode_engine={"max_num_seqs": 32}
    ) as (router, prefills, decodes):
        out = await soak(router, prefills + decodes, num_requests=2000, concurrency=64, cancel_fraction=0.2)
        await wait_for_no_blocks(prefills + decodes, timeout=15)
        out.leaked_blocks = sum(n.llm.block_manager.num_used_blocks for n in prefills + decodes)
        return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    model = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "llama")
    prompts = [[(i * 31 + j * 7) % 300 + 1 for j in range(40 + 15 * (i % 8))] for i in range(12)]
    expected = expected_tokens(model, prompts)
    rows = []
    for scenario in (prefill_gone_before, prefill_dies, transfer_fails, decode_dies):
        out = asyncio.run(scenario(model, prompts, expected, MAX_TOKENS))
        rows.append(asdict(out))
        print(out, flush=True)
    out = asyncio.run(soak_run(model))
    rows.append(asdict(out))
    print(out, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
