"""Where a decode step's time goes on CUDA, per SDPA backend choice (the run that found cuDNN's
attention costing bf16 decode steps 1.7 ms of host time per call: docs/benchmarks.md, "On a GPU").

    python benchmarks/cuda_decode_profile.py CONFIG_DIR /tmp/twin cuda 20 > docs/bench/h200_decode_profile.txt

The default model's shape with random weights (CONFIG_DIR: its config.json and tokenizer files;
a step's time does not depend on the weights' values), written once to the twin directory. 16
sequences of 64 prompt tokens decode; the median of the given number of steps, then
torch.profiler's table over 5 more. bf16 with torch's default backends, fp32, then bf16 with
cuDNN's attention off (as engine/attention.py now runs on CUDA), then bf16 with cuDNN's back on
and memory-efficient attention off: that last engine meets shapes cuDNN has planned already in
this process, so its time is not comparable. docs/bench/h200_decode_profile.txt was taken before
engine/attention.py chose its CUDA backends itself; since then the first bf16 row runs as the third.
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from random_twin import make_twin

from engine import EngineConfig, LLMEngine, SamplingParams


def run(model: Path, device: str, label: str, dtype: str, steps: int, prof: bool = True, batch: int = 16) -> None:
    llm = LLMEngine(EngineConfig(model=str(model), dtype=dtype, device=device, num_kv_blocks=4096))
    params = SamplingParams(max_tokens=steps * 2 + 20, temperature=0, ignore_eos=True)
    for i in range(batch):
        llm.add_request(str(i), [100 + i + j for j in range(64)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t)
    print(
        f"{label} {dtype}: decode step of {batch} x ~64: median {statistics.median(times) * 1e3:.2f} ms "
        f"(min {min(times) * 1e3:.2f})",
        flush=True,
    )
    if prof:
        acts = [torch.profiler.ProfilerActivity.CPU]
        acts += [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else []
        with torch.profiler.profile(activities=acts) as p:
            for _ in range(5):
                llm.step()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60), flush=True)


def main() -> None:
    src, twin, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    model = make_twin(src / "config.json", src, twin)
    run(model, device, "default", "bfloat16", steps)
    run(model, device, "default", "float32", steps, prof=False)
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
        run(model, device, "cudnn sdp off", "bfloat16", steps)
        torch.backends.cuda.enable_cudnn_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        run(model, device, "mem-efficient sdp off", "bfloat16", steps, prof=False)


if __name__ == "__main__":
    main()
