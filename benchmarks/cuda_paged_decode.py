"""Decode steps on CUDA with the Triton paged kernel (engine/cuda_kernels.py) against SDPA over
gathered KV, in one engine and one process: the same sequences, the two paths swapped between
rounds (the order alternating), so both meet the same KV and the same GPU.

    python benchmarks/cuda_paged_decode.py --model /tmp/twin8b --shapes 64x640,256x640,128x2048 \
        --dtype bfloat16 --kv-cache-gb 50 --json docs/bench/cuda_paged_decode_8b.json

--model: a model directory (a random twin from benchmarks/random_twin.py times as the real
shape). Per shape BxC: B distinct random prompts of C tokens are prefilled, then each round times
--steps decode steps (engine.step(), host work included) with the kernel and as many with SDPA.
Reports per path the median step, and the median over rounds of the per-round ratio; also the
floor a step's bytes set (weights once, plus the batch's KV) at --bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model_config import ModelConfig


def time_steps(llm: LLMEngine, kernel: bool, steps: int) -> list[float]:
    llm.runner.decode_kernel = kernel  # read when each step's attention metadata is built
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def run_shape(llm: LLMEngine, batch: int, context: int, steps: int, rounds: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    vocab = llm.runner.cfg.vocab_size
    # Prefill runs in chunks, and a sequence prefilled early decodes beside the chunks after it
    # (the sequences are aborted at the end): none may finish before the timed steps.
    params = SamplingParams(max_tokens=llm.scheduler.max_model_len - context, temperature=0, ignore_eos=True)
    for i in range(batch):
        llm.add_request(f"{seed}-{i}", torch.randint(10, vocab - 10, (context,), generator=gen).tolist(), params)
    t = time.perf_counter()
    while llm.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in llm.scheduler.running):
        llm.step()
    prefill_s = time.perf_counter() - t
    assert len(llm.scheduler.running) == batch, f"{len(llm.scheduler.running)} of {batch} sequences decode in one batch"
    time_steps(llm, True, 2)  # Triton compiles for this shape's constants; SDPA warms up
    time_steps(llm, False, 2)
    kernel, sdpa, ratios = [], [], []
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {k: time_steps(llm, k, steps) for k in order}
        kernel += got[True]
        sdpa += got[False]
        ratios.append(statistics.median(got[False]) / statistics.median(got[True]))
    for seq in list(llm.scheduler.running):
        llm.abort_request(seq.request_id)
    llm.step()
    return {
        "batch": batch,
        "context": context,
        "prefill_s": prefill_s,
        "kernel_ms": statistics.median(kernel) * 1e3,
        "sdpa_ms": statistics.median(sdpa) * 1e3,
        "speedup": statistics.median(ratios),
        "round_speedups": ratios,
        "kernel_steps_ms": [x * 1e3 for x in kernel],
        "sdpa_steps_ms": [x * 1e3 for x in sdpa],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--shapes", default="64x640,256x640,128x2048", help="BxC: B sequences with C-token contexts")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-gb", type=float, default=80)
    p.add_argument("--steps", type=int, default=5, help="decode steps per path per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the floor (an H200's copy rate)")
    p.add_argument("--json")
    args = p.parse_args()
    llm = LLMEngine(
        EngineConfig(
            model=args.model,
            device="cuda",
            dtype=args.dtype,
            kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
            max_num_seqs=256,
            enable_prefix_caching=False,
            cuda_kernels=True,
        )
    )
    assert llm.runner.decode_kernel, "the Triton kernel does not run here"
    cfg: ModelConfig = llm.runner.cfg
    itemsize = llm.kv_cache.kv.element_size()
    # the floor's weights: the checkpoint's bytes (a twin's are bf16, as the engine holds them)
    weight_bytes = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "weight_bytes": weight_bytes,
        "bandwidth": args.bandwidth,
        "steps": args.steps,
        "rounds": args.rounds,
        "shapes": [],
    }
    for i, shape in enumerate(args.shapes.split(",")):
        batch, context = (int(x) for x in shape.split("x"))
        row = run_shape(llm, batch, context, args.steps, args.rounds, seed=i)
        kv_bytes = batch * context * cfg.kv_bytes_per_token(itemsize)
        row["floor_ms"] = (weight_bytes + kv_bytes) / args.bandwidth * 1e3
        out["shapes"].append(row)
        print(
            f"{args.dtype} {batch}x{context}: kernel {row['kernel_ms']:.1f} ms, SDPA {row['sdpa_ms']:.1f} ms, "
            f"{row['speedup']:.2f}x (rounds {', '.join(f'{x:.2f}' for x in row['round_speedups'])}); "
            f"bytes' floor {row['floor_ms']:.1f} ms; prefill {row['prefill_s']:.1f} s",
            flush=True,
        )
        if args.json:  # after each shape: a run stopped at its time limit keeps the shapes it timed
            Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
