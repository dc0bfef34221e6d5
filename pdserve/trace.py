"""Arrival traces: requests replayed at their recorded times, in the Mooncake trace format (the
one NVIDIA Dynamo's planner and aiperf replay). One JSON object a line:

    {"timestamp": 0, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}

timestamp: the arrival in milliseconds; input_length / output_length: tokens (aliases
input_tokens / output_tokens); hash_ids: the prompt's blocks of --trace-block-tokens tokens
(512, the published traces' block) in order, the last one possibly partial. Two requests whose
hash_ids begin alike share those blocks' tokens, so a replay hits the prefix cache where the
traced service did. The traces carry no text: each block id becomes the same tokens wherever
it appears (drawn from a generator seeded by the id), and the tokens past the blocks are the
request's own. `pdserve bench --trace` sends them to a server; `pdserve plan simulate --trace`
and `pdserve plan best --trace` predict them.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512  # the published Mooncake traces' block; aiperf's default too
ALIASES = {"input_length": ("input_length", "input_tokens"), "output_length": ("output_length", "output_tokens")}


@dataclass(frozen=True)
class TraceRequest:
    at_s: float  # seconds after the trace's first arrival
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


def add_args(p) -> None:
    """The trace's options, for `pdserve bench` and `pdserve plan simulate | best` alike."""
    p.add_argument(
        "--trace",
        default=None,
        help="replay this Mooncake-format trace (JSONL: timestamp ms, input_length, output_length, "
        "hash_ids): its requests at its times and of its lengths (not with --rate, --concurrency, "
        "--dataset or --turns; the length options do not apply)",
    )
    p.add_argument(
        "--trace-block-tokens", type=int, default=BLOCK_TOKENS, help="tokens per hash id of the trace's blocks"
    )
    p.add_argument(
        "--trace-speedup",
        type=float,
        default=1.0,
        help="arrivals this many times as fast as the trace's (0.5: half the rate)",
    )


def read(path: str, speedup: float = 1.0, block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """The trace's requests in arrival order, their times from the first arrival, divided by speedup."""
    if not speedup > 0 or math.isinf(speedup):
        raise ValueError(f"--trace-speedup must be a positive number, got {speedup}")
    if block_tokens < 1:
        raise ValueError(f"--trace-block-tokens must be >= 1, got {block_tokens}")
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            rows.append(_row(line, f"{path}:{number}", block_tokens))
    if not rows:
        raise ValueError(f"{path}: the trace has no requests")
    rows.sort(key=lambda r: r[0])  # (stable: rows of one millisecond keep their order)
    first = rows[0][0]
    return [TraceRequest((ms - first) / 1000.0 / speedup, i, o, h) for ms, i, o, h in rows]


def _row(line: str, where: str, block_tokens: int) -> tuple[float, int, int, tuple[int, ...]]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    if "session_id" in row:
        raise ValueError(f"{where}: session_id (multi-turn replay) is not supported; each row must stand alone")
    ms = row.get("timestamp")
    if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms) or ms < 0:
        raise ValueError(f"{where}: timestamp must be a number of milliseconds >= 0, got {ms!r}")
    lengths = []
    for name, keys in ALIASES.items():
        n = next((row[k] for k in keys if k in row), None)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{where}: {name} must be an integer >= 1, got {n!r}")
        lengths.append(n)
    ids = row.get("hash_ids", [])
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    if len(ids) > math.ceil(lengths[0] / block_tokens):
        raise ValueError(
            f"{where}: {len(ids)} hash_ids of {block_tokens} tokens are more than input_length {lengths[0]} holds "
            "(is --trace-block-tokens the trace's block size?)"
        )
    return float(ms), lengths[0], lengths[1], tuple(ids)


def prompts(
    requests: list[TraceRequest], block_tokens: int, token: Callable[[random.Random], int], seed: int = 0
) -> list[list[int]]:
    """The requests' token ids: each its blocks' tokens (a block id is the same tokens in every
    request of the run), then its own tokens up to input_length. token(rng) draws one id; the
    seed draws another run's tokens (the same seed: the same prompts, which a server's prefix
    cache then holds)."""
    blocks: dict[int, list[int]] = {}
    out = []
    for index, req in enumerate(requests):
        ids: list[int] = []
        for h in req.hash_ids:
            if h not in blocks:
                rng = random.Random(f"{seed} block {h}")
                blocks[h] = [token(rng) for _ in range(block_tokens)]
            ids += blocks[h]
        del ids[req.input_length :]
        own = random.Random(f"{seed} request {index}")
        out.append(ids + [token(own) for _ in range(req.input_length - len(ids))])
    return out
