"""A lone stream on the embedded model's own GGUF file: pdserve (the default dtype, int8 and int4)
against llama.cpp (llama-cpp-python built from source in its own venv), measured in one run.

    python benchmarks/llama_cpp_lone.py --llama-cpp-python .venv-llamacpp/bin/python [--runs 5] [--json FILE]

The same chat prompt's token ids go to both, 128 greedy tokens each (EOS ignored), the same
threads (2 by default). pdserve: one process with an engine per mode, warmed up.
llama.cpp: a child process under the other venv, `Llama(model_path=the Q4_1 GGUF, n_threads)`,
warmed up on the same prompt, then the prompt evaluated and 128 tokens sampled greedily with
`llama_cpp`'s own loop. tokens/s = generated tokens / wall time (the prompt's evaluation included,
as for pdserve); the modes' order rotates between runs. Reported: medians over runs and the
per-run ratios to llama.cpp. A batch is not compared: llama-cpp-python runs one sequence.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.summary import emit, median_of, ratio  # noqa: E402

MAX_TOKENS = 128
MODES = ("none", "int8", "int4")
LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
path, threads, max_tokens, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompt = json.loads(sys.stdin.read())
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)

def once():
    llm.reset()
    start, n = time.perf_counter(), 0
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        n += 1
        if n == max_tokens:
            break
    return n / (time.perf_counter() - start)

once()  # warm-up
print(json.dumps([once() for _ in range(runs)]))
"""


def pdserve_lone(llm, prompt: list[int]) -> float:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return len(out.token_ids) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-python", required=True, help="the python of a venv with llama-cpp-python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs; figures are their medians")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()
    from engine_throughput import chat_prompts

    from engine import LLM, SamplingParams
    from engine.hardware import cpu_features
    from engine.model_source import embedded_gguf_path

    gguf = embedded_gguf_path("smollm2-135m")
    engines = {q: LLM(kv_cache_bytes=1 << 28, quantization=q, num_threads=args.threads) for q in MODES}
    prompt = chat_prompts(engines["none"].engine.tokenizer, 1)[0]
    for llm in engines.values():
        llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    runs = []
    for i in range(args.runs):
        run = {}
        for q in MODES[i % 3 :] + MODES[: i % 3]:
            run[f"pdserve {q}"] = pdserve_lone(engines[q], prompt)
        child = subprocess.run(
            [args.llama_cpp_python, "-c", LLAMA_CPP, str(gguf), str(args.threads), str(MAX_TOKENS), "1"],
            input=json.dumps(prompt),
            capture_output=True,
            text=True,
            check=True,
        )
        run["llama.cpp"] = json.loads(child.stdout)[0]
        runs.append(run)
    summary = {
        "cpu_class": cpu_features().isa,
        "gguf": gguf.name,
        "prompt_tokens": len(prompt),
        "max_tokens": MAX_TOKENS,
        "threads": args.threads,
        "runs": runs,
        "median": {key: median_of(runs, lambda r, key=key: r[key]) for key in runs[0]},
        **{
            f"ratio_pdserve_{q}_over_llama_cpp": ratio(runs, lambda r, q=q: r[f"pdserve {q}"], lambda r: r["llama.cpp"])
            for q in MODES
        },
    }
    emit(summary, args.json)


if __name__ == "__main__":
    main()
