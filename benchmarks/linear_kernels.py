"""The CPU linears' two kernels, oneDNN's prepacked weights against engine/csrc/ordered_linear.cpp,
on the default model, measured in one run (what `linear_kernel auto` chooses between).

    python benchmarks/linear_kernels.py [--dtype auto] [--threads 1,2] [--runs 3] [--json FILE]

1. The linears alone: deterministic.py's linears() (the model's shapes, random weights, the sum of
   one forward's calls), at each row count and thread count: oneDNN time / ordered time.
2. The offline engine, each run its own subprocess, the two kernels interleaved, at each thread
   count: engine_throughput.py's chat prompts, a full batch (N x M generated tokens), a lone
   stream (1 x L tokens), and prefill alone (P random prompts of the anchor's 610 tokens, one
   token each: prompt tokens/s). Greedy,
   ignore_eos, after a warm-up. Reported: medians and the median of the per-run ratios
   (ordered / oneDNN).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNELS = ("onednn", "ordered")


def workloads(args) -> dict[str, tuple[int, int, int]]:
    """name: (prompts, their length (0: chat prompts), generated tokens each)."""
    return {
        "batch": (args.num_prompts, 0, args.max_tokens),
        "lone": (1, 0, args.lone_tokens),
        "prefill": (args.prefill_prompts, args.prefill_len, 1),
    }


def throughput(dtype: str, kernel: str, prompts: int, length: int, tokens: int, threads: int) -> dict:
    import torch
    from engine_throughput import chat_prompts

    from engine import LLM, SamplingParams

    llm = LLM(dtype=dtype, linear_kernel=kernel, num_threads=threads, kv_cache_bytes=1 << 30)
    chats = chat_prompts(llm.engine.tokenizer, prompts + 8)
    llm.generate(chats[:8], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    chats = chats[8:]  # not the warm-up's (prefix cache)
    if length:  # random tokens: no prefix shared with anything before
        gen = torch.Generator().manual_seed(0)
        chats = torch.randint(100, llm.engine.model_config.vocab_size, (prompts, length), generator=gen).tolist()
    start = time.perf_counter()
    outs = llm.generate(chats, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "tokens_per_s": generated / elapsed,
        "prompt_tokens_per_s": prompt_tokens / elapsed,
        "elapsed_s": elapsed,
        "dtype": str(llm.engine.dtype),
    }


def spawn(*child: str) -> dict:
    cmd = [sys.executable, __file__, "--child", *child]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(child)} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{' '.join(child)}: {result}", file=sys.stderr, flush=True)
    return result


def child(argv: list[str]) -> dict:
    import torch

    what, dtype, threads = argv[0], argv[1], int(argv[2])
    torch.set_num_threads(threads)
    if what == "linears":
        from deterministic import linears

        if dtype == "auto":
            from engine.hardware import resolve_dtype

            dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
        got = linears(dtype, [int(r) for r in argv[3].split(",")])
        return {
            rows: {"onednn_ms": t["default_ms"], "ordered_ms": t["ordered_ms"], "speed": t["speed"]}
            for rows, t in got.items()
        }
    kernel, prompts, length, tokens = argv[3], int(argv[4]), int(argv[5]), int(argv[6])
    return throughput(dtype, kernel, prompts, length, tokens, threads)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2:])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2")
    ap.add_argument("--runs", type=int, default=3, help="runs of each workload and kernel (0: the linears only)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lone-tokens", type=int, default=128)
    ap.add_argument("--workloads", default="batch,lone,prefill")
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=610, help="tokens in each prefill prompt (the anchor's)")
    ap.add_argument("--linear-rows", default="1,4,8,16,64,256,610", help="row counts for the linears alone ('': none)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from engine.hardware import cpu_features

    began = time.monotonic()
    out = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_features().isa,
        "dtype": args.dtype,
        "linears": {},
        "engine": {},
    }
    for threads in [int(t) for t in args.threads.split(",")]:
        if args.linear_rows:
            out["linears"][str(threads)] = spawn("linears", args.dtype, str(threads), args.linear_rows)
        for name, (prompts, length, tokens) in workloads(args).items():
            if not args.runs or name not in args.workloads.split(","):
                continue
            runs = {kernel: [] for kernel in KERNELS}
            for r in range(args.runs):
                for kernel in KERNELS if r % 2 == 0 else reversed(KERNELS):
                    got = spawn("engine", args.dtype, str(threads), kernel, *map(str, (prompts, length, tokens)))
                    runs[kernel].append(got["prompt_tokens_per_s" if name == "prefill" else "tokens_per_s"])
            out["engine"][f"{name}, {threads} thread{'s' * (threads > 1)}"] = {
                "workload": f"{prompts} {'chat' if not length else f'{length}-token'} prompts x {tokens} tokens",
                "unit": "prompt tokens/s" if name == "prefill" else "generated tokens/s",
                "runs": runs,
                "median": {kernel: statistics.median(v) for kernel, v in runs.items()},
                "median_ratio": statistics.median(o / d for o, d in zip(runs["ordered"], runs["onednn"])),
            }
    out["seconds"] = round(time.monotonic() - began)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
