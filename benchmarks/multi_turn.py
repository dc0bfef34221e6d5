"""Multi-turn chat with a long shared system prompt: prefix caching on and off, disaggregated and colocated.

    python benchmarks/multi_turn.py [--out docs/bench] [--conversations 16] [--turns 5]

The workload: C conversations of T turns; every conversation starts with the same ~1,000-token
system prompt, each turn is a ~40-token question, each answer 32 tokens. `pdserve bench --dataset`
sends each turn after the previous answer, its prompt the conversation so far, closed loop at
concurrency 4 (four conversations in flight). The servers, one after another on the same 2 cores,
default model in bf16 (SERVERS below; --only picks some): `pdserve up` (1 prefill + 1 decode node,
one core and one torch thread each) with prefix caching on and off, and with conditional
disaggregation off (--local-prefill off: every prefill through the prefill pool), the same unpinned, two prefill
nodes with and without cache-aware routing, and one colocated engine (both cores, 2 threads) with
prefix caching on and off.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from disagg_vs_colocated import wait_line

ROOT = Path(__file__).resolve().parent.parent
SLO_TTFT, SLO_TPOT = 1.0, 0.1
SYSTEM = (
    "You are the support assistant of a lighthouse museum. Answer visitors' questions politely and "
    "briefly, using the facts below. "
) + (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home. Engineers later "
    "built towers of stone with lamps and lenses, and keepers lived beside them through storms. "
) * 27
TOPICS = [
    "the lenses",
    "the keepers",
    "storms",
    "the stone towers",
    "opening hours",
    "tickets",
    "the gift shop",
    "school visits",
    "the fog horn",
    "the lamp oil",
    "the staircase",
    "the view",
    "the ships",
    "the harbour",
    "photography",
    "accessibility",
]


def dataset(path: Path, conversations: int, turns: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    lines = []
    for c in range(conversations):
        asked = []
        for t in range(turns):
            topic = rng.choice(TOPICS)
            question = (
                f"Visitor {c}, question {t + 1}: could you tell me more about {topic}, and how it relates "
                f"to what you said before about {asked[-1] if asked else 'the museum'}? Please keep it short."
            )
            asked.append(topic)
            lines.append(
                json.dumps(
                    {"conversation_id": c, "turn": t, "prompt": (SYSTEM + "\n\n" if t == 0 else "\n\n") + question}
                )
            )
    path.write_text("\n".join(lines) + "\n")


def bench(address: str, data: Path, out: Path, name: str, conversations: int) -> dict:
    json_path = out / f"multi_turn_{name}.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "bench",
            "--addr",
            address,
            "--seed",
            "0",
            "--dataset",
            str(data),
            "--num-requests",
            str(conversations),
            "--concurrency",
            "4",
            "--output-len",
            "32",
            "--slo-ttft",
            str(SLO_TTFT),
            "--slo-tpot",
            str(SLO_TPOT),
            "--json",
            str(json_path),
            "--quiet",
        ],
        check=True,
    )
    return json.loads(json_path.read_text())


UP = [sys.executable, "-m", "pdserve", "up", "--port", "0", "--kv-cache-gb", "0.5"]
PINNED, SHARED = ["--num-threads", "1", "--pin-cpus"], ["--num-threads", "2"]  # shared: unpinned, 2 threads per node
SERVERS = {  # name: (command, the line that announces the address, the address's field in it)
    "disaggregated-cached": ([*UP, "--prefill", "1", "--decode", "1", *PINNED], "pdserve up: router on", 4),
    # conditional disaggregation off: every prefill through the prefill pool
    "disaggregated-cached-remote": (
        [*UP, "--prefill", "1", "--decode", "1", *PINNED, "--local-prefill", "off"],
        "pdserve up: router on",
        4,
    ),
    "disaggregated-uncached": (
        [*UP, "--prefill", "1", "--decode", "1", *PINNED, "--no-prefix-caching"],
        "pdserve up: router on",
        4,
    ),
    # the prefill node, idle most of the time once prompts are cached, leaves both cores to the decode node
    "disaggregated-cached-shared": ([*UP, "--prefill", "1", "--decode", "1", *SHARED], "pdserve up: router on", 4),
    "disaggregated-cached-shared-remote": (
        [*UP, "--prefill", "1", "--decode", "1", *SHARED, "--local-prefill", "off"],
        "pdserve up: router on",
        4,
    ),
    # two prefill nodes: cache-aware routing against least-outstanding alone
    "2p-cache-aware": ([*UP, "--prefill", "2", "--decode", "1", *SHARED], "pdserve up: router on", 4),
    "2p-cache-blind": (
        [*UP, "--prefill", "2", "--decode", "1", *SHARED, "--cache-affinity-tokens", "0"],
        "pdserve up: router on",
        4,
    ),
    "colocated-cached": (
        [sys.executable, "-m", "pdserve", "colocated", "--port", "0", "--num-threads", "2", "--kv-cache-gb", "0.5"],
        "READY ",
        1,
    ),
    "colocated-uncached": (
        [
            sys.executable,
            "-m",
            "pdserve",
            "colocated",
            "--port",
            "0",
            "--num-threads",
            "2",
            "--kv-cache-gb",
            "0.5",
            "--no-prefix-caching",
        ],
        "READY ",
        1,
    ),
}


def serve(name: str):
    command, announce, field = SERVERS[name]
    via_stderr = announce.startswith("pdserve up")
    proc = subprocess.Popen(
        command, text=True, **({"stderr": subprocess.PIPE} if via_stderr else {"stdout": subprocess.PIPE})
    )
    return proc, wait_line(proc, proc.stderr if via_stderr else proc.stdout, announce).split()[field]


def summary(name: str, data: dict) -> dict:
    rep = data["runs"][0]["report"]
    row = {
        "name": name,
        "tps": rep["tps"],
        "ttft_p50": rep["ttft_s"]["p50"],
        "ttft_p95": rep["ttft_s"]["p95"],
        "tpot_p50": rep["tpot_s"]["p50"],
        "goodput_rps": rep["goodput_rps"],
        "good": rep["good_requests"],
        "completed": rep["completed"],
        "hit_rate": rep["prefix_cache_hit_rate"],
        "duration_s": rep["duration_s"],
        "local_prefill_rate": rep.get("local_prefill_rate", 0.0),
    }
    print(
        f"{name:>27}: {row['tps']:6.1f} tok/s, TTFT p50 {row['ttft_p50']:.2f} s p95 {row['ttft_p95']:.2f} s, "
        f"TPOT p50 {row['tpot_p50'] * 1e3:.1f} ms, goodput {row['good']}/{row['completed']} = "
        f"{row['goodput_rps']:.3f} req/s, cache hit rate {row['hit_rate']:.1%}, "
        f"{row['local_prefill_rate']:.0%} prefilled locally, {row['duration_s']:.1f} s",
        flush=True,
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--only", default="disaggregated-cached,disaggregated-uncached,colocated-cached,colocated-uncached")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "multi_turn.jsonl"
    dataset(data, args.conversations, args.turns)
    rows = []
    for name in args.only.split(","):
        proc, address = serve(name)
        try:
            rows.append(summary(name, bench(address, data, out, name, args.conversations)))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    by = {r["name"]: r for r in rows}
    ratios = {}
    for a, b in (
        ("disaggregated-cached", "disaggregated-uncached"),
        ("disaggregated-cached", "colocated-cached"),
        ("disaggregated-cached-shared", "colocated-cached"),
        ("colocated-cached", "colocated-uncached"),
        ("2p-cache-aware", "2p-cache-blind"),
        ("disaggregated-cached", "disaggregated-cached-remote"),
        ("disaggregated-cached-shared", "disaggregated-cached-shared-remote"),
    ):
        if a in by and b in by and by[b]["goodput_rps"]:
            ratios[f"{a} / {b}"] = by[a]["goodput_rps"] / by[b]["goodput_rps"]
            print(f"goodput {a} / {b}: {ratios[f'{a} / {b}']:.2f}", flush=True)
    (out / "multi_turn.json").write_text(
        json.dumps(
            {
                "slo": {"ttft_s": SLO_TTFT, "tpot_s": SLO_TPOT},
                "conversations": args.conversations,
                "turns": args.turns,
                "rows": rows,
                "goodput_ratios": ratios,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
