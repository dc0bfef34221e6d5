"""The decode step's own cost on one core, and what the decode attention kernel costs in it:
this tree's kernel against the one of an earlier commit, interleaved in one process.

    python benchmarks/decode_step.py [--before 19d690d] [--rounds 5] [--json docs/bench/decode_step.json]

The earlier kernel is built from `git show <before>:engine/csrc/paged_attention.cpp` under the op
namespace `pdserve_before`. Kernel alone: B sequences of 650 tokens, 30 layers' KV in scattered
blocks (60 MB at B = 4 in bf16, cold in the caches as in the model), every layer once per step. Engine:
the default model (dtype auto), one torch thread, B sequences decoding with 610-token contexts; each
round times 20 steps with either kernel swapped in. Reports medians and the median of per-round
ratios. Run it pinned (taskset -c 1) on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams, cpu_kernels
from engine.hardware import cpu_features, resolve_dtype

ROOT = Path(__file__).resolve().parent.parent


def build_before(rev: str, source: str = "paged_attention.cpp") -> None:
    """engine/csrc/<source> as of <rev>, built under the op namespace pdserve_before."""
    src = subprocess.run(
        ["git", "show", f"{rev}:engine/csrc/{source}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    src = src.replace("TORCH_LIBRARY_FRAGMENT(pdserve,", "TORCH_LIBRARY_FRAGMENT(pdserve_before,")
    src = src.replace("TORCH_LIBRARY_IMPL(pdserve,", "TORCH_LIBRARY_IMPL(pdserve_before,")
    tmp = Path(tempfile.mkdtemp(prefix="pdserve_before_"))
    (tmp / source).write_text(src)
    (tmp / "to_float.h").write_text((ROOT / "engine/csrc/to_float.h").read_text())
    from torch.utils.cpp_extension import load

    load(
        name=f"pdserve_before_{Path(source).stem}_{rev.replace('~', '_')}",
        sources=[str(tmp / source)],
        extra_cflags=cpu_kernels.BASE_FLAGS + cpu_features().kernel_flags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )


def kernel_alone(kernels: dict, batch: int, ctx: int, rounds: int, dtype: torch.dtype) -> dict:
    hq, hkv, d, bs, layers = 9, 3, 64, 16, 30
    g = torch.Generator().manual_seed(0)
    width = (ctx + bs - 1) // bs
    nblocks = batch * width + 8
    ks = [torch.randn(nblocks * bs, hkv, d, generator=g).to(dtype) for _ in range(layers)]
    vs = [torch.randn_like(k) for k in ks]
    bt = torch.randperm(nblocks, generator=g)[: batch * width].view(batch, width).contiguous()
    cl = torch.full((batch,), ctx, dtype=torch.long)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    times = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, op in kernels.items():
            op(out, q, ks[0], vs[0], bt, cl, bs, d**-0.5, 0)
            per_step = []
            for _ in range(10):
                t = time.perf_counter()
                for k, v in zip(ks, vs):
                    op(out, q, k, v, bt, cl, bs, d**-0.5, 0)
                per_step.append(time.perf_counter() - t)
            times[name].append(statistics.median(per_step) * 1e3)
    kv_bytes = batch * ctx * hkv * d * 2 * dtype.itemsize * layers
    return summary(
        times,
        {
            "kv_mb_per_step": kv_bytes / 1e6,
            "gbps": {n: kv_bytes / statistics.median(t) / 1e6 for n, t in times.items()},
        },
    )


def engine_steps(engine: LLMEngine, kernels: dict, batch: int, ctx: int, rounds: int) -> dict:
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=rounds * len(kernels) * 25 + 10, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [rng.randrange(100, 40000) for _ in range(ctx)], params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    ns = torch.ops.pdserve
    times = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, op in kernels.items():
            ns.paged_decode_attention = op
            engine.step()
            per_step = []
            for _ in range(20):
                t = time.perf_counter()
                engine.step()
                per_step.append(time.perf_counter() - t)
            times[name].append(statistics.median(per_step) * 1e3)
    ns.paged_decode_attention = kernels["now"]
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    return summary(times, {})


def summary(times: dict, extra: dict) -> dict:
    ratios = [b / n for b, n in zip(times["before"], times["now"])]
    return {
        "ms": {n: statistics.median(t) for n, t in times.items()},
        "rounds_ms": times,
        "speedup": statistics.median(ratios),
        **extra,
    }


def kernel_ab(doc: str, before: str, source: str = "paged_attention.cpp") -> argparse.Namespace:
    """The command line of a kernel's A/B against an earlier commit's (this script's and
    linear_tiles.py's), parsed; one torch thread, this tree's kernels built and the earlier
    commit's engine/csrc/<source> beside them (build_before)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=before, help="the commit whose kernel is the baseline")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has it natively, else fp32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    assert cpu_kernels.load(), "the C++ CPU kernels do not build here"
    build_before(args.before, source)
    return args


def main() -> None:
    args = kernel_ab(__doc__, "19d690d")
    kernels = {
        "now": torch.ops.pdserve.paged_decode_attention,
        "before": torch.ops.pdserve_before.paged_decode_attention,
    }
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    result = {"cpu": cpu_features().isa, "dtype": str(dtype), "before": args.before, "kernel": {}, "engine": {}}
    for batch in (1, 4, 8):
        result["kernel"][f"B={batch}"] = r = kernel_alone(kernels, batch, 650, args.rounds, dtype)
        print(
            f"kernel B={batch}: {r['ms']['before']:.2f} -> {r['ms']['now']:.2f} ms per step "
            f"({r['gbps']['before']:.1f} -> {r['gbps']['now']:.1f} GB/s), {r['speedup']:.2f}x",
            flush=True,
        )
    engine = LLMEngine(EngineConfig(dtype=args.dtype, enable_prefix_caching=False, kv_cache_bytes=1 << 30))
    for batch in (1, 4, 8):
        result["engine"][f"B={batch}"] = r = engine_steps(engine, kernels, batch, 610, args.rounds)
        print(
            f"engine step B={batch}, 610-token contexts: {r['ms']['before']:.1f} -> {r['ms']['now']:.1f} ms, "
            f"{r['speedup']:.2f}x",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
