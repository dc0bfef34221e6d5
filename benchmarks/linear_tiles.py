"""The ordered linear (engine/csrc/ordered_linear.cpp) of this tree against an earlier commit's, over
one forward's linears of the default model at 1-12 rows (a decode step's) and 64 and 256 (a prefill
chunk's), interleaved in one process.

    python benchmarks/linear_tiles.py [--before 64b8b31] [--rounds 5] [--dtype auto] [--json FILE]

The earlier kernel is built from git under the op namespace `pdserve_before` (decode_step.py's
build_before). Each of the 30 layers has weights of its own (qkv, o, gate_up, down) and the LM head
follows, so the weights stream from memory as in a decode step; each kernel packs its own copy.
One torch thread; each round times every row count with either kernel (median of 5 forwards), the
two in turn, which one first alternating from round to round.
Reports the median forward time per row count and the median of per-round ratios. Run it pinned
(taskset -c 1) on a quiet machine.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's engine, not an installed one

from decode_step import kernel_ab  # noqa: E402

from engine.hardware import cpu_features, resolve_dtype
from engine.model_config import ModelConfig
from engine.model_source import resolve_model

ROWS = (*range(1, 13), 64, 256)


def forward(ops, panels: list, xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for p, out_features, in_features in panels:
        ops.ordered_linear(xs[in_features], p, None, out_features)
    return time.perf_counter() - start


def main() -> None:
    args = kernel_ab(__doc__, "64b8b31", "ordered_linear.cpp")
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    cfg = ModelConfig.from_dir(resolve_model("smollm2-135m"))
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = [(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q), (2 * cfg.intermediate_size, cfg.hidden_size)]
    shapes = (layer + [(cfg.hidden_size, cfg.intermediate_size)]) * cfg.num_layers + [(cfg.vocab_size, cfg.hidden_size)]
    gen = torch.Generator().manual_seed(0)
    weights = [((torch.randn(o, i, generator=gen) * 0.05).to(dtype), o, i) for o, i in shapes]
    kernels = {"now": torch.ops.pdserve, "before": torch.ops.pdserve_before}
    panels = {n: [(ops.ordered_linear_pack(w), o, i) for w, o, i in weights] for n, ops in kernels.items()}
    xs = {m: {i: torch.randn(m, i, generator=gen).to(dtype) for _, i in set(shapes)} for m in ROWS}
    times = {m: {n: [] for n in kernels} for m in ROWS}
    for round_ in range(args.rounds):
        for m in ROWS:
            for n, ops in list(kernels.items())[:: 1 if round_ % 2 == 0 else -1]:
                forward(ops, panels[n], xs[m])
                times[m][n].append(statistics.median(forward(ops, panels[n], xs[m]) for _ in range(5)) * 1e3)
    result = {"cpu": cpu_features().isa, "dtype": str(dtype), "before": args.before, "rows": {}}
    for m in ROWS:
        t = times[m]
        ratio = statistics.median(b / n for b, n in zip(t["before"], t["now"]))
        result["rows"][str(m)] = {
            "ms": {n: statistics.median(v) for n, v in t.items()},
            "rounds_ms": t,
            "speedup": ratio,
        }
        print(
            f"{m:2d} rows: {statistics.median(t['before']):.1f} -> {statistics.median(t['now']):.1f} ms, {ratio:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
