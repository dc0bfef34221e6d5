"""The simulator against measured runs: `pdserve plan simulate`'s prediction beside `pdserve bench`
on the real deployment, same prompts, same window.

    python benchmarks/plan_accuracy.py [--profile FILE] [--out docs/bench] [--only anchor,chat] [--step-log]

1. Profiles this machine (`pdserve plan profile`, threads 1 and 2, default model, dtype auto),
   unless --profile gives one measured earlier.
2. Two workloads, both as token ids (so the simulator sees the very prompts the servers get):
   anchor: 32 requests of 590-630 tokens, 64 output tokens, closed loop at concurrency 8;
   chat: 8 conversations of 4 turns, a shared 1,000-token system prompt, ~40-token questions,
   32-token answers, closed loop at concurrency 4. Output lengths are fixed (ignore_eos); decoding is greedy unless
   --temperature is given (to both the requests and the simulator).
   With --trace FILE and --only trace (or a list naming it), a third: the trace's requests at
   its times (`pdserve bench --trace`; the simulator shares the same blocks).
3. Deployments on the 2 cores, each started, measured by `pdserve bench`, stopped:
   colocated (one engine, 2 threads), colocated on one core (one engine, 1 thread, pinned to core
   0), colocated x 2 (`up --prefill 0 --decode 2`, one core each), 1P1D with local prefill auto
   (the default), 1P1D with local prefill off; the P/D and x2 ones pinned, one thread per node.
   Named with --deployments only: 1P1D-beside16, 1P1D with --prefill-tokens-with-decodes 16.
4. For each, the simulator's prediction from the profile; the relative error of goodput (tokens/s
   within both SLOs), TTFT p50 and TPOT p50. The SLOs (WORKLOADS) are loose enough that nearly
   every request of every deployment meets them here: an SLO that cuts through the middle of a
   latency distribution turns a small error in the latency into a large one in goodput.
   Each row keeps both sides' per-request records (sent, first token, done, local or remote).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from disagg_vs_colocated import wait_line  # noqa: E402

from engine import EngineConfig  # noqa: E402
from pdserve import trace  # noqa: E402
from pdserve.bench import add_temperature  # noqa: E402
from pdserve.plan import profile as profiles  # noqa: E402
from pdserve.plan import profile_file, search  # noqa: E402
from pdserve.plan.simulator import Deployment, Item, Simulation, Workload, traced  # noqa: E402
from serving.launcher import ServerProcess  # noqa: E402

FIGURES = ("goodput_tps", "ttft_p50_s", "tpot_p50_s")  # the goal's: each within 15% of the measured
VOCAB = (100, 49000)  # token ids drawn from the default model's vocabulary
WORKLOADS = {
    # name: (SLO TTFT s, SLO TPOT s)
    "anchor": (30.0, 0.35),
    "chat": (8.0, 0.15),
    "trace": (10.0, 0.2),  # --trace FILE
}
DEPLOYMENTS = {
    d.name: d
    for d in (
        Deployment("colocated", colocated=1, threads=2),
        Deployment("colocated-1core", colocated=1, threads=1),
        Deployment("colocated-x2", colocated=2, threads=1),
        Deployment("1P1D", prefill=1, decode=1, threads=1),
        Deployment("1P1D-off", prefill=1, decode=1, threads=1, local_prefill="off"),
        Deployment("1P1D-beside16", prefill=1, decode=1, threads=1, prefill_tokens_with_decodes=16),
        Deployment("1P1D-tpot84", prefill=1, decode=1, threads=1, max_local_tpot=0.0842),  # plan best's AVX2 pick
    )
}


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def workload(name: str, trace_path: str | None = None, seed: int = 0) -> Workload:
    """The simulator's workload: the very token ids bench_args sends, or the trace's requests
    (whose blocks the simulator shares as the server does)."""
    if name == "trace":
        return traced(trace.read(trace_path))
    rng = random.Random(seed)
    if name == "anchor":
        return Workload([Item([ids(rng, rng.randint(590, 630))], 64) for _ in range(32)], concurrency=8)
    system = ids(rng, 1000)
    turns = [[system + ids(rng, 40)] + [ids(rng, rng.randint(30, 50)) for _ in range(3)] for _ in range(8)]
    return Workload([Item(t, 32) for t in turns], concurrency=4)


def bench_args(name: str, work: Workload, tmp: Path, trace_path: str | None) -> list[str]:
    """`pdserve bench`'s arguments for the same workload: the trace, or a dataset of its token ids."""
    if name == "trace":
        return ["--trace", trace_path]
    lines = [{"prompt_token_ids": it.turns[0]} if len(it.turns) == 1 else {"turns": it.turns} for it in work.items]
    data = tmp / f"{name}.jsonl"
    data.write_text(
        "".join(json.dumps(line | {"max_tokens": it.output_len}) + "\n" for line, it in zip(lines, work.items))
    )
    return ["--dataset", str(data), "--num-requests", str(len(lines)), "--concurrency", str(work.concurrency)]


def serve(command: list[str]):
    """(address, stop) of a started deployment."""
    if command[0] == "colocated":
        server = ServerProcess(["-m", "pdserve", *command, "--port", "0", "--kv-cache-gb", "0.5"])
        return server.wait_ready(), lambda: server.stop(60)
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve", *command, "--port", "0", "--kv-cache-gb", "0.5"],
        stderr=subprocess.PIPE,
        text=True,
    )
    address = wait_line(up, up.stderr, "pdserve up: router on").split()[4]

    def stop():
        up.terminate()
        up.wait(timeout=60)

    return address, stop


def measure(command: list[str], bench_args: list[str], slo: tuple[float, float], tmp: Path) -> dict:
    out = tmp / "bench.json"
    address, stop = serve(command)
    try:
        subprocess.run(
            [sys.executable, "-m", "pdserve", "bench", "--addr", address, *bench_args]
            + ["--slo-ttft", str(slo[0]), "--slo-tpot", str(slo[1]), "--json", str(out), "--quiet"],
            check=True,
        )
    finally:
        stop()
    return json.loads(out.read_text())["runs"][0]  # its report and records


def runs_on(prof: dict, profile_path: str, paths: list[Path], ap: argparse.ArgumentParser) -> list[dict]:
    """The runs (plan_accuracy.json files), each checked against what it recorded of its profile:
    model, machine, date and dtype (two profiles of one machine and day pass alike)."""
    runs = [json.loads(p.read_text()) for p in paths]
    for path, run in zip(paths, runs):
        if run["profile"] != profiles.provenance(prof, time.monotonic())["profile"]:
            ap.error(f"{path} was measured on the profile {run['profile']}, not on {profile_path}")
    return runs


GOAL = 0.15  # the bound on the relative error


def rows_of(runs: list[dict], workload: str, deployment: str) -> list[dict]:
    """One cell's rows over several runs (plan_accuracy.json files)."""
    return [r for run in runs for r in run["rows"] if (r["workload"], r["deployment"]) == (workload, deployment)]


def error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured else float("inf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="a profile measured earlier (default: measure one first)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--only", default="anchor,chat", help="workloads, of " + ", ".join(WORKLOADS))
    ap.add_argument("--trace", help="a trace (pdserve/trace.py) as the workload 'trace'")
    ap.add_argument(
        "--deployments", default=",".join(d for d in DEPLOYMENTS if d not in ("1P1D-beside16", "1P1D-tpot84"))
    )
    ap.add_argument(
        "--step-log", action="store_true", help="keep each engine's steps in its row (the nodes' --step-log)"
    )
    add_temperature(ap)  # the requests' (bench's) and the simulated workload's
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    if args.profile:
        prof = profile_file.load(args.profile)
    else:
        prof = profiles.profile(EngineConfig.model, EngineConfig.dtype, "cpu", [1, 2], 3, quick=False)
        profile_file.write(prof, args.out / "plan_profile.json")
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-plan-") as tmp:
        for wname in args.only.split(","):
            if wname == "trace" and not args.trace:
                ap.error("the workload 'trace' needs --trace FILE")
            work = dataclasses.replace(workload(wname, args.trace), temperature=args.temperature)
            slo = WORKLOADS[wname]
            for dname in args.deployments.split(","):
                dep = DEPLOYMENTS[dname]
                command = shlex.split(search.command(dep))[1:]  # the command `pdserve plan best` prints
                steps = Path(tmp) / f"steps-{wname}-{dname}.jsonl"
                command += ["--step-log", str(steps)] if args.step_log else []
                sim = Simulation(prof, dep, *slo)
                predicted = sim.run(work)
                sent = bench_args(wname, work, Path(tmp), args.trace) + ["--temperature", str(args.temperature)]
                run = measure(command, sent, slo, Path(tmp))
                measured = run["report"]
                row = {"workload": wname, "deployment": dname, "slo_ttft_s": slo[0], "slo_tpot_s": slo[1]}
                row |= {"trace": args.trace} if wname == "trace" else {}
                for key, pred, meas in (
                    ("goodput_tps", predicted.goodput_tps, measured["goodput_tps"]),
                    ("tps", predicted.tps, measured["tps"]),
                    ("ttft_p50_s", predicted.ttft_s["p50"], measured["ttft_s"]["p50"]),
                    ("tpot_p50_s", predicted.tpot_s["p50"], measured["tpot_s"]["p50"]),
                    ("local_prefill_rate", predicted.local_prefill_rate, measured["local_prefill_rate"]),
                ):
                    row[key] = {"predicted": pred, "measured": meas, "error": error(pred, meas)}
                row["records"] = {"predicted": [r.__dict__ for r in sim.records], "measured": run["records"]}
                if args.step_log:
                    row["steps"] = [json.loads(line) for line in steps.read_text().splitlines()]
                rows.append(row)
                print(
                    f"{wname:7s} {dname:13s} "
                    + "  ".join(
                        f"{k} {row[k]['predicted']:.3g}/{row[k]['measured']:.3g} ({row[k]['error']:.0%})"
                        for k in FIGURES
                    ),
                    flush=True,
                )
    result = {
        **profiles.provenance(prof, began),
        "temperature": args.temperature,
        "rows": rows,
    }
    (args.out / "plan_accuracy.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
