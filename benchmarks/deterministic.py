"""Deterministic mode: what it costs and what it buys, on the default model, measured in one run.

    python benchmarks/deterministic.py [--dtypes bfloat16,float32] [--runs 3] [--num-prompts 64] [--json FILE]
        [--prompt-tokens 1000] [--modes default,deterministic,deterministic_onednn_chunks]

1. Throughput: engine_throughput.py's chat prompts, or with --prompt-tokens prompts of that many
   random tokens (a prefill-heavy workload), N x M generated tokens, ignore_eos, greedy; the
   offline engine in each mode (default, deterministic with linear_kernel auto, deterministic with
   onednn_chunks), in each dtype. Each run is its own subprocess, the
   modes interleaved; tokens/s = N x M / the timed generate's wall time (after a warm-up). Reported:
   the medians and the median of the per-run ratios (each mode / default).
2. Batch invariance: benchmarks/speculative.py's 16 prompts, greedy with the chosen token's
   logprob, each alone and then beside the next prompt (prefix caching off),
   with the mode off and on, in each dtype: how many outputs' tokens change, and how many change
   in any logprob bit.
3. The linears alone (--linear-rows): the default model's linear shapes, oneDNN's prepacked kernel
   ("default" in the JSON: the default before linear_kernel auto chose the ordered kernel on x86
   CPUs without AMX; F.linear where oneDNN cannot) against the ordered kernel and onednn_chunks
   (oneDNN on 32 rows a call), at each row count, median of repeated calls, in one process; the
   model's sum (layers x each layer's linears + the LM head) as the ratio default time / each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {  # name: the engine settings
    "default": {},
    "deterministic": {"deterministic": True},
    "deterministic_onednn_chunks": {"deterministic": True, "linear_kernel": "onednn_chunks"},
}


def throughput(dtype: str, mode: dict, num_prompts: int, max_tokens: int, prompt_tokens: int) -> dict:
    import torch
    from engine_throughput import chat_prompts

    from engine import LLM, SamplingParams

    llm = LLM(dtype=dtype, kv_cache_bytes=1 << 30, **mode)
    if prompt_tokens:  # distinct random ids: nothing for the prefix cache to share
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(100, llm.engine.model_config.vocab_size, (num_prompts + 8, prompt_tokens), generator=gen)
        prompts, warm = ids[:num_prompts].tolist(), ids[num_prompts:].tolist()
    else:
        prompts = chat_prompts(llm.engine.tokenizer, num_prompts)
        warm = prompts[:8]
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    return {"tokens_per_s": generated / elapsed, "elapsed_s": elapsed, "dtype": str(llm.engine.dtype)}


def invariance(dtype: str, mode: dict, max_tokens: int) -> dict:
    from speculative import workloads

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.tokenizer import apply_chat_template

    config = EngineConfig(dtype=dtype, enable_prefix_caching=False, kv_cache_bytes=1 << 28, **mode)
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0)
    tok = engine.tokenizer
    prompts = [tok.encode(apply_chat_template(tok, c)) for w in workloads().values() for c in w]

    def run(batch: list[list[int]]) -> tuple[list[int], list]:
        for i, p in enumerate(batch):
            engine.add_request(f"r{i}", p, params)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return done["r0"].token_ids, done["r0"].logprobs

    tokens = logprobs = 0
    for i, prompt in enumerate(prompts):
        alone, beside = run([prompt]), run([prompt, prompts[(i + 1) % len(prompts)]])
        tokens += alone[0] != beside[0]
        logprobs += alone != beside
    return {"prompts": len(prompts), "tokens_differ": tokens, "tokens_or_logprobs_differ": logprobs}


def linears(dtype: str, row_counts: list[int]) -> dict:
    import torch

    from engine import cpu_kernels
    from engine.linear import Linear
    from engine.model_config import ModelConfig
    from engine.model_source import resolve_model

    if not cpu_kernels.load():
        raise SystemExit("the ordered linear needs the C++ CPU kernels, which did not build here")
    cfg = ModelConfig.from_dir(resolve_model("smollm2-135m"))
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {  # name: (out, in, times a forward runs it)
        "qkv": (q + 2 * kv, cfg.hidden_size, cfg.num_layers),
        "o": (cfg.hidden_size, q, cfg.num_layers),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size, cfg.num_layers),
        "down": (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers),
        "lm_head": (cfg.vocab_size, cfg.hidden_size, 1),
    }
    gen, dt = torch.Generator().manual_seed(0), getattr(torch, dtype)

    def seconds(f, calls: int) -> float:
        f()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    names = ("default", "ordered", "onednn_chunks")
    model = {rows: dict.fromkeys(names, 0.0) for rows in row_counts}
    for out_features, in_features, count in shapes.values():
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dt)
        kernels = {name: Linear(weight, kernel="onednn" if name == "default" else name) for name in names}
        for rows in row_counts:
            x = torch.randn(rows, in_features, generator=gen).to(dt)
            calls = 5 if rows * out_features > 1 << 18 else 20
            for name, linear in kernels.items():
                model[rows][name] += count * seconds(lambda linear=linear, x=x: linear(x), calls)
    return {
        str(rows): {f"{name}_ms": t[name] * 1e3 for name in names}
        | {f"speed_{name}": t["default"] / t[name] for name in names[1:]}
        for rows, t in model.items()
    }


def child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    mode = MODES[args.mode]
    if args.child == "throughput":
        return throughput(args.dtype, mode, args.num_prompts, args.max_tokens, args.prompt_tokens)
    if args.child == "linears":
        return linears(args.dtype, [int(r) for r in args.linear_rows.split(",")])
    return invariance(args.dtype, mode, args.invariance_tokens)


def spawn(what: str, dtype: str, mode: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", what, "--dtype", dtype, "--mode", mode, "--threads", str(args.threads)]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
    cmd += ["--prompt-tokens", str(args.prompt_tokens)]
    cmd += ["--invariance-tokens", str(args.invariance_tokens), "--linear-rows", args.linear_rows]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} {dtype} {mode} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{what} {dtype} {mode}: {result}", file=sys.stderr, flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--runs", type=int, default=3, help="0: no throughput runs")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="prompts of this many random tokens (0: chat prompts)")
    ap.add_argument("--modes", default="default,deterministic", help=f"of {', '.join(MODES)}; default first")
    ap.add_argument("--invariance-tokens", type=int, default=64, help="0: throughput only")
    ap.add_argument("--linear-rows", default="", help="row counts for the linears alone, e.g. 1,4,16,64,256")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=("throughput", "invariance", "linears"), help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    from engine.hardware import cpu_features

    began, dtypes = time.monotonic(), args.dtypes.split(",")
    out = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_features().isa,
        "threads": args.threads,
        "workload": f"{args.num_prompts} {f'{args.prompt_tokens}-token' if args.prompt_tokens else 'chat'} prompts "
        f"x {args.max_tokens} tokens",
        "throughput": {},
        "invariance": {},
        "linears": {},
    }
    modes = args.modes.split(",")
    for dtype in dtypes:
        runs = {mode: [] for mode in modes}
        for r in range(args.runs):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:  # each run begins with another
                runs[mode].append(spawn("throughput", dtype, mode, args)["tokens_per_s"])
        if args.runs:
            out["throughput"][dtype] = {
                "tokens_per_s": runs,
                "median_tokens_per_s": {mode: statistics.median(v) for mode, v in runs.items()},
                "median_ratio": {
                    mode: statistics.median(on / off for on, off in zip(runs[mode], runs[modes[0]]))
                    for mode in modes[1:]
                },
            }
        if args.invariance_tokens:
            out["invariance"][dtype] = {mode: spawn("invariance", dtype, mode, args) for mode in modes}
        if args.linear_rows:
            out["linears"][dtype] = spawn("linears", dtype, "deterministic", args)
    out["seconds"] = round(time.monotonic() - began)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
