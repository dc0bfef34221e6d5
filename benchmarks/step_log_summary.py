"""What a P/D pair's engines did, from their step logs (engine/step_log.py; `pdserve up --step-log`,
benchmarks/vllm_peer.py --step-logs DIR): per log file, the decode node's decode-only steps (the
median milliseconds per batch size), its steps that also prefilled (local prefills: how many, their
prompt tokens, the median step), the prefill node's seconds per 610 prompt tokens, the share
of the log's span (its first step's start to its last step's end) each node spent stepping, and
where the prefill node stood idle: its gaps of over GAP_S between steps (seconds, in order) and
the tail after its last step.

    python benchmarks/step_log_summary.py DIR/steps_*.jsonl [--json FILE]

The decode node is the engine (pid) whose steps decode; every other pid in the file prefills.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

MIN_STEPS = 10  # batch sizes with fewer decode-only steps are left out
GAP_S = 0.05  # a pause between a prefill node's steps longer than this is idle time


def summary(path: Path) -> dict:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    decoders = {s["pid"] for s in steps if s["decodes"]}
    by_batch: dict[int, list[float]] = defaultdict(list)
    local, remote = [], []
    for s in steps:
        if s["pid"] not in decoders:
            if s["prefills"]:
                remote.append(s["s"] / sum(n for n, _ in s["prefills"]) * 610)
        elif s["prefills"]:
            local.append(s)
        else:
            by_batch[len(s["decodes"])].append(s["s"] * 1e3)
    span = max(s["t"] + s["s"] for s in steps) - min(s["t"] for s in steps)
    busy = {"decode": 0.0, "prefill": 0.0}
    for s in steps:
        busy["decode" if s["pid"] in decoders else "prefill"] += s["s"]
    start, gaps, free_at = min(s["t"] for s in steps), [], None
    for s in sorted((s for s in steps if s["pid"] not in decoders), key=lambda s: s["t"]):
        since = s["t"] - (start if free_at is None else free_at)
        if since > GAP_S:
            gaps.append(round(since, 2))
        free_at = s["t"] + s["s"]
    return {
        "span_s": round(span, 1),
        "busy_share": {node: round(b / span, 2) for node, b in busy.items()},
        "decode_node_steps": sum(s["pid"] in decoders for s in steps),
        "decode_step_ms_by_batch": {
            b: round(statistics.median(v), 1) for b, v in sorted(by_batch.items()) if len(v) >= MIN_STEPS
        },
        "local_prefill_steps": len(local),
        "local_prefill_tokens": sum(n for s in local for n, _ in s["prefills"]),
        "local_prefill_step_s_p50": round(statistics.median(s["s"] for s in local), 3) if local else None,
        "prefill_node_s_per_610_tokens": round(statistics.median(remote), 3) if remote else None,
        "prefill_node_idle_gaps_s": gaps,
        "prefill_node_tail_s": round(start + span - free_at, 2) if free_at is not None else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    logs = {path.name: summary(path) for path in sorted(args.logs)}
    for name, s in logs.items():
        print(name, json.dumps(s))
    out = {"command": " ".join(["python", *sys.argv]), "logs": logs}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
