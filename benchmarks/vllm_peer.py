"""pdserve's disaggregated pair against vLLM's CPU build in P/D mode, same workload, same window.

    python benchmarks/vllm_peer.py [--rounds 2] [--json docs/bench/vllm_peer.json]

Both are driven by one load generator through their OpenAI-compatible /v1/completions
(benchmarks/peers/vllm_cpu_pd/bench.py, vendored from the peer harness: 32 requests of ~610-token
prompts, 64 output tokens, ignore_eos, greedy, streaming, concurrency 8), one system after the
other, in interleaved rounds:
- vLLM 0.32 CPU, 1 prefill + 1 decode instance (NIXL connector with the harness's patches, each
  pinned to one core), behind the harness's proxy;
- pdserve up --prefill 1 --decode 1 --num-threads 1 --pin-cpus, its router's HTTP API (and with
  --also-args "FLAGS", the same with more `pdserve up` flags, e.g. "--max-local-prefill-tokens 512";
  repeatable, one more system each; with --step-logs DIR, each pdserve run's engine steps in DIR,
  the warm-up's left out);
- with --single, also vLLM as one instance on both cores (the harness's start_single.sh), to
  show in the same window what disaggregation itself costs vLLM on these cores.
vLLM runs from .venv-vllm (docs/benchmarks.md says how to make it); both load the same model
directory (pdserve's cached conversion of the default model).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "benchmarks" / "peers" / "vllm_cpu_pd"
MEDIANS = ("out_tok_s", "ttft_p50_ms", "tpot_p50_ms", "tpot_p95_ms", "itl_p95_ms", "itl_p99_ms", "itl_max_ms")


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> float:
    started = time.time()
    while time.time() < started + timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.time() - started
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def load(url: str, model: str, tag: str, out: Path, vllm_python: str, step_log: Path | None = None) -> dict:
    subprocess.run(
        [vllm_python, str(PEER / "bench.py"), url, "--n", "4", "--conc", "2", "--tag", f"warm{tag}", "--model", model],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    if step_log is not None:  # the measured run's steps only (the engines append at the end, now 0)
        os.truncate(step_log, 0)
    subprocess.run(
        [
            vllm_python,
            str(PEER / "bench.py"),
            url,
            "--n",
            "32",
            "--conc",
            "8",
            "--tag",
            tag,
            "--model",
            model,
            "--out",
            str(out),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return json.loads(out.read_text())["summary"]


def run_vllm(model_dir: str, venv: Path, logs: Path, tag: str, dtype: str) -> dict:
    env = {
        **os.environ,
        "PEER_DIR": str(PEER),
        "VLLM_VENV": str(venv),
        "MODEL_DIR": model_dir,
        "KV_STORE": str(logs / "kvstore"),
        "PYTHONPATH": str(PEER / "patches"),
        "PD_KEEP_AFFINITY": "1",
        "PD_NIXL_PTHR_DELAY_US": "500",
    }
    procs = []
    try:
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            procs.append(
                subprocess.Popen(
                    ["bash", str(PEER / "start_pd.sh"), role, "nixl", "--dtype", dtype],
                    env={**env, "NIXL_ROLE": kv_role},
                    stdout=open(logs / f"vllm_{role}.log", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
        for port in (8101, 8102):
            wait_http(f"http://127.0.0.1:{port}/health", procs[-1])
        env.pop("PYTHONPATH")
        procs.append(
            subprocess.Popen(
                [str(venv / "bin" / "python"), str(PEER / "proxy.py"), "--port", "8200"],
                env=env,
                stdout=open(logs / "vllm_proxy.log", "w"),
                stderr=subprocess.STDOUT,
            )
        )
        time.sleep(2)
        return load(
            "http://127.0.0.1:8200/v1/completions", "smol", tag, logs / f"vllm_{tag}.json", str(venv / "bin" / "python")
        )
    finally:
        stop(procs)


def run_vllm_single(model_dir: str, venv: Path, logs: Path, tag: str, dtype: str) -> dict:
    env = {**os.environ, "PEER_DIR": str(PEER), "VLLM_VENV": str(venv), "MODEL_DIR": model_dir}
    proc = subprocess.Popen(
        ["bash", str(PEER / "start_single.sh"), "8100", "auto", "--dtype", dtype],
        env=env,
        stdout=open(logs / "vllm_single.log", "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http("http://127.0.0.1:8100/health", proc)
        return load(
            "http://127.0.0.1:8100/v1/completions", "smol", tag, logs / f"vllm_{tag}.json", str(venv / "bin" / "python")
        )
    finally:
        stop([proc])


def run_pdserve(logs: Path, tag: str, vllm_python: str, extra: list[str], step_log: Path | None = None) -> dict:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--num-threads",
            "1",
            "--pin-cpus",
            "--port",
            "0",
            "--http-port",
            "8300",
            *extra,
            *(["--step-log", str(step_log)] if step_log else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(logs / f"pdserve_{tag}.log", "w"),
    )
    try:
        wait_http("http://127.0.0.1:8300/health", proc)
        with urllib.request.urlopen("http://127.0.0.1:8300/v1/models") as r:
            model = json.loads(r.read())["data"][0]["id"]
        url, out = "http://127.0.0.1:8300/v1/completions", logs / f"pdserve_{tag}.json"
        return load(url, model, tag, out, vllm_python, step_log)
    finally:
        stop([proc])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--logs", default="/tmp/pdserve-vllm-peer")
    ap.add_argument("--json", default=str(ROOT / "docs" / "bench" / "vllm_peer.json"))
    ap.add_argument(
        "--also-args",
        action="append",
        default=[],
        help="also run pdserve with these `pdserve up` flags, e.g. '--max-num-batched-tokens 1024' (repeatable)",
    )
    ap.add_argument("--step-logs", type=Path, help="write each pdserve run's engine step log here (--step-log)")
    ap.add_argument("--single", action="store_true", help="also run vLLM as one instance on both cores")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="both systems' dtype (default: what pdserve's --dtype auto picks on this CPU: bf16 where it "
        "is native, else fp32; the model directory says bf16, which vLLM would otherwise run emulated)",
    )
    args = ap.parse_args()
    import torch

    from engine.hardware import cpu_features, resolve_dtype
    from engine.model_source import resolve_model

    dtype = args.dtype or str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")

    model_dir = str(resolve_model("smollm2-135m"))
    logs = Path(args.logs)
    (logs / "kvstore").mkdir(parents=True, exist_ok=True)
    venv = Path(args.vllm_venv)

    def pdserve(flags: list[str]):
        def run(tag: str) -> dict:
            log = None
            if args.step_logs:
                log = args.step_logs / f"steps_{tag}.jsonl"
                log.unlink(missing_ok=True)  # a step log appends: not a previous run's steps beside these
            return run_pdserve(logs, tag, str(venv / "bin" / "python"), ["--dtype", dtype, *flags], log)

        return run

    if args.step_logs:
        args.step_logs.mkdir(parents=True, exist_ok=True)
    systems = {"vllm-pd": lambda tag: run_vllm(model_dir, venv, logs, tag, dtype), "pdserve-pd": pdserve([])}
    for flags in args.also_args:
        systems["pdserve-pd " + flags] = pdserve(flags.split())
    if args.single:
        systems["vllm-single"] = lambda tag: run_vllm_single(model_dir, venv, logs, tag, dtype)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for i, name in enumerate(systems):
        print(f"system s{i}: {name}", flush=True)
    for r in range(args.rounds):
        for i, (name, run) in enumerate(systems.items()):
            # the tag goes into every prompt (unique per run: no cache hits across runs), so all are one length
            s = run(f"s{i}r{r:02d}")
            runs[name].append(s)
            print(
                f"round {r} {name:>10}: {s['out_tok_s']:6.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
                f"TPOT p50 {s['tpot_p50_ms']:.1f} ms p95 {s['tpot_p95_ms']:.1f} ms",
                flush=True,
            )
    med = {name: {k: statistics.median(s[k] for s in rs) for k in MEDIANS} for name, rs in runs.items()}
    ratios = {}
    for name in runs:
        if name != "vllm-pd":
            ratios[name] = [p["out_tok_s"] / v["out_tok_s"] for p, v in zip(runs[name], runs["vllm-pd"])]
            print(
                f"tokens/s {name} / vLLM per round: {', '.join(f'{x:.2f}' for x in ratios[name])}; "
                f"median {statistics.median(ratios[name]):.2f}",
                flush=True,
            )
    result = {"command": shlex.join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"), "dtype": dtype}
    result |= {"cpu": cpu_features().isa, "runs": runs, "medians": med, "tps_ratio_per_round": ratios}
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
