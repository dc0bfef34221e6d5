"""Offline engine throughput: N requests x M generated tokens (ignore_eos) on the default model,
measured in one run for pdserve's engine, transformers' static-batch generate, and vLLM's CPU
build (when its venv exists).

    python benchmarks/engine_throughput.py                 # all three, 64 x 128, dtype auto, 3 runs each
    python benchmarks/engine_throughput.py --only pdserve  # one of them

Each run of a system is its own subprocess, the systems interleaved, with the same prompts; each
first does a short warm-up. Reported: generated tokens/s = N * M / wall time of the timed
generate, its median over the runs, and the median of the per-run ratios.
vLLM runs from a separate venv (default .venv-vllm, see docs/benchmarks.md for its setup).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPICS = [
    "the ocean",
    "volcanoes",
    "the moon",
    "honey bees",
    "the Roman Empire",
    "black holes",
    "jazz music",
    "photosynthesis",
    "the printing press",
    "glaciers",
    "chess",
    "the internet",
    "rainforests",
    "electric cars",
    "ancient Egypt",
    "coffee",
]
TASKS = [
    "Write a short paragraph about {}.",
    "Explain {} to a ten-year-old.",
    "List five interesting facts about {}.",
    "Write a short poem about {}.",
]


def make_prompts(n: int) -> list[str]:
    return [TASKS[i % len(TASKS)].format(TOPICS[(i // len(TASKS)) % len(TOPICS)]) for i in range(n)]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for p in make_prompts(n)
    ]


def run_pdserve(prompts: list[list[int]], max_tokens: int, args) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_bytes=2 << 30, scheduling=args.scheduling)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return {
        "elapsed_s": elapsed,
        "generated": sum(len(o.token_ids) for o in outs),
        "preemptions": llm.engine.scheduler.num_preemptions,
        "token_ids": [o.token_ids for o in outs],
    }


def run_transformers(prompts: list[list[int]], max_tokens: int, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.hardware import resolve_device
    from engine.model_source import resolve_model

    model_dir = resolve_model(args.model)
    device = resolve_device(args.device)  # the device pdserve's engine runs on
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    pad = model.config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left padding: one batch
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    eos = model.config.vocab_size  # an id it never produces: all max_tokens steps, like ignore_eos
    with torch.inference_mode():
        model.generate(
            ids[:8], attention_mask=mask[:8], max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=pad
        )
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad
        ).cpu()  # waits for the device
        elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "generated": int((out.shape[1] - width) * len(prompts)),
        "token_ids": out[:, width:].tolist(),
    }


def same_tokens(first_ids: dict[str, list[list[int]]]) -> dict | None:
    """How many requests' greedy tokens pdserve's engine and transformers agree on, all of them,
    and how many leading tokens they share at the median (one run each, in the run's dtype)."""
    if "pdserve" not in first_ids or "transformers" not in first_ids:
        return None
    pairs = list(zip(first_ids["pdserve"], first_ids["transformers"]))
    shared = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs]
    return {
        "requests": len(pairs),
        "identical": sum(a == b for a, b in pairs),
        "median_shared_prefix": statistics.median(shared),
    }


def run_vllm(prompts_file: str, max_tokens: int, args) -> dict:
    python = Path(args.vllm_venv) / "bin" / "python"
    if not python.exists():
        return {"skipped": f"{python} not found"}
    cmd = [
        str(python),
        str(ROOT / "benchmarks" / "vllm_throughput.py"),
        prompts_file,
        str(max_tokens),
        str(args.model_dir),
        args.dtype,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd="/tmp")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": r.stderr[-2000:]}
    return json.loads(lines[-1])


def run_system(system: str, prompts_file: Path, args) -> dict:
    if system == "vllm":
        return run_vllm(str(prompts_file), args.max_tokens, args)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        system,
        "--prompts-file",
        str(prompts_file),
        "--max-tokens",
        str(args.max_tokens),
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--scheduling",
        args.scheduling,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if r.returncode == 0 and lines else {"error": r.stderr[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto", help="auto: what the engine picks on this machine (engine/hardware.py)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--scheduling", default="continuous")
    ap.add_argument("--only", help="the systems to run, comma-separated (pdserve, transformers, vllm); default all")
    ap.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--repeat", type=int, default=3, help="runs per system, interleaved; medians reported")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:  # one system, in its own process
        prompts = json.loads(Path(args.prompts_file).read_text())
        runner = {"pdserve": run_pdserve, "transformers": run_transformers}[args.child]
        print(json.dumps(runner(prompts, args.max_tokens, args)))
        return 0

    import torch
    from transformers import AutoTokenizer

    from engine.hardware import cpu_features, resolve_device, resolve_dtype
    from engine.model_source import resolve_model

    if args.dtype == "auto":  # every system runs the dtype the engine picks here
        args.dtype = str(resolve_dtype("auto", resolve_device(args.device))).removeprefix("torch.")
    cpu = cpu_features()
    device = resolve_device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None

    args.model_dir = resolve_model(args.model)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(args.model_dir), args.num_requests)
    lens = sorted(len(p) for p in prompts)
    tmp = tempfile.TemporaryDirectory(prefix="pdserve-throughput-")  # removed when the runs end
    prompts_file = Path(tmp.name) / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    print(
        f"{args.num_requests} requests x {args.max_tokens} tokens, prompt tokens min/median/max "
        f"{lens[0]}/{lens[len(lens) // 2]}/{lens[-1]}, {args.dtype}, torch threads {os.cpu_count()}, "
        f"CPU class {cpu.isa} ({cpu.reason})" + (f", on {gpu}" if gpu else "")
    )
    asked = set(args.only.split(",")) if args.only else {"pdserve", "transformers", "vllm"}
    if asked - {"pdserve", "transformers", "vllm"}:
        ap.error(f"--only: unknown systems {sorted(asked - {'pdserve', 'transformers', 'vllm'})}")
    systems = [s for s in ["pdserve", "transformers", "vllm"] if s in asked]
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    first_ids: dict[str, list[list[int]]] = {}  # each system's greedy tokens in its first run
    for rep in range(args.repeat):  # interleaved, so that a noisy minute hits all systems alike
        for system in systems:
            res = run_system(system, prompts_file, args)
            if "elapsed_s" in res:
                res["tokens_per_s"] = res["generated"] / res["elapsed_s"]
                print(
                    f"run {rep + 1} {system:>13}: {res['tokens_per_s']:8.1f} generated tokens/s "
                    f"({res['elapsed_s']:.2f} s)",
                    flush=True,
                )
            else:
                print(f"run {rep + 1} {system:>13}: {res}", flush=True)
            ids = res.pop("token_ids", None)
            if rep == 0 and ids is not None:
                first_ids[system] = ids
            runs[system].append(res)
    tmp.cleanup()
    results = {
        "workload": {
            "num_requests": args.num_requests,
            "max_tokens": args.max_tokens,
            "dtype": args.dtype,
            "prompt_tokens_median": lens[len(lens) // 2],
        },
        "cpu": {"class": cpu.isa, "reason": cpu.reason},
        "gpu": gpu,
        "same_greedy_tokens_as_transformers": same_tokens(first_ids),
        "runs": runs,
        "median_tokens_per_s": {},
    }
    for system, rs in runs.items():
        tps = [r["tokens_per_s"] for r in rs if "tokens_per_s" in r]
        if tps:
            results["median_tokens_per_s"][system] = statistics.median(tps)
    med = results["median_tokens_per_s"]
    print("median generated tokens/s: " + ", ".join(f"{s} {v:.1f}" for s, v in med.items()))
    if same := results["same_greedy_tokens_as_transformers"]:
        print(
            f"greedy tokens equal to transformers' ({args.dtype}): {same['identical']} of {same['requests']} requests, "
            f"median {same['median_shared_prefix']} leading tokens shared"
        )
    for other in ["transformers", "vllm"]:
        pairs = [
            a["tokens_per_s"] / b["tokens_per_s"]
            for a, b in zip(runs.get("pdserve", []), runs.get(other, []))
            if "tokens_per_s" in a and "tokens_per_s" in b
        ]
        if pairs:
            results[f"pdserve_over_{other}"] = {"per_run": pairs, "median": statistics.median(pairs)}
            print(
                f"pdserve / {other}: median {statistics.median(pairs):.2f}x "
                f"(runs: {', '.join(f'{p:.2f}' for p in pairs)})"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
