"""What a second engine decoding on the host's other core costs a decode step: one
`pdserve up --prefill 0 --decode 2 --pin-cpus --num-threads 1` (two engines, a core each), served
in rounds that alternate one stream (one engine decodes, the other idles) and two (both decode,
one stream each), the same prompt length and output each time. Each engine's decode steps come
from its step log (engine/step_log.py).

    python benchmarks/decode_beside.py [--rounds 3] [--prompt-len 1190] [--output-len 120] [--json F]

Per round: the median decode step of the engine alone, of each engine beside the other, and their
ratio (both engines' median over the one alone in the same round). The profile times its decode
grid with one engine at a time; plan_steps.py sets served steps beside what the other engines ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plan_accuracy import serve  # noqa: E402


def decode_steps(log: Path) -> dict[int, list[float]]:
    """Each engine's (pid's) decode-only steps of one sequence, in seconds."""
    by_pid = defaultdict(list)
    for line in log.read_text().splitlines():
        step = json.loads(line)
        if len(step["decodes"]) == 1 and not step["prefills"]:
            by_pid[step["pid"]].append(step["s"])
    return by_pid


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of one stream, then two (default: 3)")
    ap.add_argument("--prompt-len", type=int, default=1190, help="tokens per prompt (default: 1190, chat's context)")
    ap.add_argument("--output-len", type=int, default=120, help="tokens each stream decodes (default: 120)")
    ap.add_argument("--json", type=Path, help="write the rounds here (default: none)")
    args = ap.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="pdserve-beside-") as tmp:
        log = Path(tmp) / "steps.jsonl"
        address, stop = serve(
            ["up", "--prefill", "0", "--decode", "2", "--pin-cpus", "--num-threads", "1"] + ["--step-log", str(log)]
        )
        try:
            for r in range(args.rounds):
                medians = {}
                for streams in (1, 2):
                    log.write_bytes(b"")
                    subprocess.run(
                        [sys.executable, "-m", "pdserve", "bench", "--addr", address, "--quiet"]
                        + ["--num-requests", str(streams), "--concurrency", str(streams)]
                        + ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)],
                        check=True,
                        stdout=subprocess.DEVNULL,
                    )
                    steps = decode_steps(log)
                    if len(steps) != streams:
                        raise SystemExit(f"round {r + 1}: {streams} streams decoded on {len(steps)} engines")
                    medians[streams] = sorted(statistics.median(s) * 1e3 for s in steps.values())
                ratio = statistics.median(medians[2]) / medians[1][0]
                rounds.append({"alone_ms": medians[1][0], "beside_ms": medians[2], "ratio": ratio})
                print(
                    f"round {r + 1}: alone {medians[1][0]:.1f} ms, beside "
                    + ", ".join(f"{m:.1f}" for m in medians[2])
                    + f" ms: {ratio:.2f}x",
                    flush=True,
                )
        finally:
            stop()
    summary = {"ratio_median": statistics.median(r["ratio"] for r in rounds)}
    print(f"median ratio over {len(rounds)} rounds: {summary['ratio_median']:.2f}x")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    **vars(args) | {"json": str(args.json)},
                    "rounds": rounds,
                    **summary,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
