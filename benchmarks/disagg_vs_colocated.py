"""Disaggregated against colocated on equal hardware, and the decode batch-size trade-off.

    python benchmarks/disagg_vs_colocated.py [--out docs/bench] [--sizes none] [--json NAME]

1. The mixed workload of the vLLM anchor: 32 requests of ~610 prompt tokens (590-630) and 64
   output tokens, closed loop at concurrency 8, streaming, the default model in bf16, run by
   `pdserve bench` against (a) `pdserve up` with 1 prefill + 1 decode node, each pinned to one
   core with 1 torch thread, and (b) one colocated engine (both phases, chunked prefill mixed into
   the decode batch) on both cores with 2 threads.
2. Decode batch size: one decode node alone, B sequences decoding together (short prompts,
   128 tokens each, all admitted at once), for B = 1..128: TPS and TPOT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from serving.launcher import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
SLO_TTFT, SLO_TPOT = 3.0, 0.035


def wait_line(proc: subprocess.Popen, stream, prefix: str) -> str:
    for line in stream:
        if line.startswith(prefix):
            threading.Thread(target=stream.read, daemon=True).start()
            return line
    raise RuntimeError(f"process exited before printing {prefix!r}")


def bench(address: str, out: Path, name: str) -> dict:
    json_path = out / f"{name}.json"
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
            "--num-requests",
            "32",
            "--concurrency",
            "8",
            "--prompt-len",
            "uniform:590:630",
            "--output-len",
            "64",
            "--slo-ttft",
            str(SLO_TTFT),
            "--slo-tpot",
            str(SLO_TPOT),
            "--json",
            str(json_path),
            "--plot",
            str(out / name),
            "--quiet",
        ],
        check=True,
    )
    return json.loads(json_path.read_text())


def disaggregated(out: Path, extra: list[str] = ()) -> dict:
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--port",
            "0",
            "--num-threads",
            "1",
            "--pin-cpus",
            "--kv-cache-gb",
            "0.5",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = wait_line(up, up.stderr, "pdserve up: router on").split()[4]
        return bench(address, out, "disaggregated")
    finally:
        up.terminate()
        up.wait(timeout=60)


def colocated(out: Path, extra: list[str] = ()) -> dict:
    server = ServerProcess(
        ["-m", "pdserve", "colocated", "--port", "0", "--num-threads", "2", "--kv-cache-gb", "0.5", *extra]
    )
    try:
        return bench(server.wait_ready(), out, "colocated")
    finally:
        server.stop(60)


def batch_sizes(sizes: list[int]) -> list[dict]:
    """Decode-only throughput of one engine (1 thread, one core) at each batch size."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_threads=1, kv_cache_bytes=1 << 30))
    rows = []
    for b in sizes:
        for i in range(b):
            engine.add_request(
                f"{b}-{i}", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
            )
        engine.step()  # the prefill of all B
        steps = []
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        tpot = statistics.median(steps)
        rows.append({"batch": b, "tpot_ms": tpot * 1e3, "tps": b / tpot})
        print(f"  batch {b:4d}: TPOT {tpot * 1e3:7.2f} ms, {b / tpot:8.1f} tokens/s", flush=True)
    return rows


def plot_batch(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["batch"] for r in rows], [r["tps"] for r in rows], "o-", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size (sequences)")
    ax.set_ylabel("tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot([r["batch"] for r in rows], [r["tpot_ms"] for r in rows], "s--", color="tab:red")
    ax2.set_ylabel("TPOT (ms)", color="tab:red")
    ax.set_title("Decode on one core: throughput and TPOT vs batch size")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(name: str, data: dict) -> dict:
    rep = data["runs"][0]["report"]
    row = {
        "name": name,
        "tps": rep["tps"],
        "ttft_p50": rep["ttft_s"]["p50"],
        "ttft_p95": rep["ttft_s"]["p95"],
        "tpot_p50": rep["tpot_s"]["p50"],
        "tpot_p95": rep["tpot_s"]["p95"],
        "goodput_rps": rep["goodput_rps"],
        "good": rep["good_requests"],
        "completed": rep["completed"],
    }
    print(
        f"{name:>14}: {row['tps']:6.1f} tok/s, TTFT p50 {row['ttft_p50']:.2f} s p95 {row['ttft_p95']:.2f} s, "
        f"TPOT p50 {row['tpot_p50'] * 1e3:.1f} ms p95 {row['tpot_p95'] * 1e3:.1f} ms, goodput "
        f"{row['good']}/{row['completed']} = {row['goodput_rps']:.3f} req/s",
        flush=True,
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64,128", help="decode batch sizes; none: experiment 1 only")
    ap.add_argument("--json", default="disagg_vs_colocated.json", help="the summary's file name in --out")
    ap.add_argument("--up-args", default="", help="more `pdserve up` flags for the disaggregated cluster")
    ap.add_argument("--colocated-args", default="", help="more `pdserve colocated` flags for the colocated engine")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [
        summary("disaggregated", disaggregated(out, args.up_args.split())),
        summary("colocated", colocated(out, args.colocated_args.split())),
    ]
    sizes = []
    if args.sizes != "none":
        print("decode batch size (one engine, one core, 1 thread):", flush=True)
        sizes = batch_sizes([int(s) for s in args.sizes.split(",")])
        plot_batch(sizes, out / "batch_size.png")
    (out / args.json).write_text(
        json.dumps({"slo": {"ttft_s": SLO_TTFT, "tpot_s": SLO_TPOT}, "rows": rows, "batch_sizes": sizes}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
