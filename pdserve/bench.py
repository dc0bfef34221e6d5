"""`pdserve bench`: a load generator against any pdserve address (router, Ray proxy, or an
aggregated server: anything serving pdserve.v1.Generation).

Open loop: arrivals at --rate requests/s (Poisson or constant gaps), optionally capped at
--concurrency requests in flight; closed loop: --concurrency workers, each sending its next
request when the last one finishes; a trace (pdserve/trace.py): its requests at its times. Prompts
come from a JSONL file or from length distributions (`N`, `uniform:A:B`, `normal:MEAN:STD`), made
of the server's own tokens. Streaming is on: TTFT is the first streamed token. A comma-separated
--rate runs a sweep.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import grpc

from pdserve import trace
from pdserve.bench_stats import Report, RequestRecord, format_report, report
from router.client import AsyncClient

FILLER = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home. Engineers "
    "later built towers of stone with lamps and lenses, and keepers lived beside them through storms. "
)


def add_temperature(p) -> None:
    """Every request's sampling temperature (`pdserve bench`'s, and the workload `pdserve plan` prices)."""
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0.0)")


def length_sampler(spec: str, rng: random.Random):
    """'128' | 'uniform:A:B' | 'normal:MEAN:STD' -> a function returning a length >= 1."""
    parts = spec.split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            return lambda: n
        kind, a, b = parts[0], float(parts[1]), float(parts[2])
    except (ValueError, IndexError):
        raise ValueError(f"length spec must be N, uniform:A:B or normal:MEAN:STD, got {spec!r}") from None
    if kind == "uniform":
        return lambda: rng.randint(int(a), int(b))
    if kind == "normal":
        return lambda: max(1, round(rng.gauss(a, b)))
    raise ValueError(f"length spec must be N, uniform:A:B or normal:MEAN:STD, got {spec!r}")


def read_dataset(path: str) -> list[dict]:
    """JSONL -> items. A line is one prompt ({"prompt": text} or {"prompt_token_ids": [...]}, optional
    "max_tokens"), or a conversation: a list of turns, {"turns": [...]}, or one turn per line
    {"conversation_id": id, "turn": k, "prompt": ...}; a turn is text, token ids or {"prompt": ...}.
    A conversation's turns go out one after another, each after the previous answer, each prompt
    holding the earlier turns and answers: {"turns": [...], "max_tokens": n}."""
    items, conversations = [], {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        where = f"{path}:{number}"
        if isinstance(row, list) or "turns" in row:
            turns = row if isinstance(row, list) else row["turns"]
            items.append({"turns": [_turn(t, where) for t in turns], "max_tokens": _max_tokens(row, where)})
        elif "conversation_id" in row:
            conv = conversations.setdefault(row["conversation_id"], {"turns": [], "max_tokens": None})
            conv["turns"].append((row.get("turn", len(conv["turns"])), _turn(row, where)))
            conv["max_tokens"] = _max_tokens(row, where) or conv["max_tokens"]
            if len(conv["turns"]) == 1:
                items.append(conv)
        else:
            items.append({"prompt": _turn(row, where), "max_tokens": _max_tokens(row, where)})
    for conv in conversations.values():
        conv["turns"] = [t for _, t in sorted(conv["turns"], key=lambda kt: kt[0])]
    if any("turns" in it and not it["turns"] for it in items):
        raise ValueError(f"{path}: a conversation without turns")
    return items


def _turn(turn, where: str):
    if isinstance(turn, dict):
        turn = turn.get("prompt_token_ids") or turn.get("prompt")
    if isinstance(turn, str) and turn or isinstance(turn, list) and turn and all(isinstance(t, int) for t in turn):
        return turn
    raise ValueError(
        f"{where}: each prompt or turn must be non-empty text or token ids ('prompt' or 'prompt_token_ids')"
    )


def _max_tokens(row, where: str) -> int | None:
    n = row.get("max_tokens") if isinstance(row, dict) else None
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {n!r}")
    return n


async def build_workload(
    client: AsyncClient, args, rng: random.Random, requests: list[trace.TraceRequest] | None = None
) -> list[dict]:
    """A list of requests, {"prompt": ids or text, "max_tokens": n}, or conversations,
    {"turns": [ids, ...], "max_tokens": n}; with a trace's requests, theirs at their times."""
    if requests is not None:
        pool = await client.tokenize(FILLER * 40)  # the server's own tokens
        ids = trace.prompts(requests, args.trace_block_tokens, lambda g: pool[g.randrange(len(pool))], args.seed)
        return [{"prompt": p, "max_tokens": r.output_length, "at": r.at_s} for p, r in zip(ids, requests)]
    if args.dataset:
        items = read_dataset(args.dataset)
        for item in items:  # turns as token ids: each prompt is then exactly the history + the turn
            if "turns" in item:
                item["turns"] = [t if isinstance(t, list) else await client.tokenize(t) for t in item["turns"]]
        items = [dict(items[i % len(items)]) for i in range(args.num_requests)]
    else:
        pool = await client.tokenize(FILLER * 40)  # the server's own tokens
        prompt_len, output_len = length_sampler(args.prompt_len, rng), length_sampler(args.output_len, rng)
        items = []
        for _ in range(args.num_requests):
            # A window of the filler, led by 8 random tokens of it: the filler repeats itself, and
            # windows alone started with the same blocks (~18% of blocks were prefix-cache hits), so
            # each prompt is its own from its first block (the cache hit rate is reported).
            n, start = prompt_len(), rng.randrange(len(pool))
            head = [rng.choice(pool) for _ in range(min(n, 8))]
            items.append(
                {
                    "prompt": head + [pool[(start + i) % len(pool)] for i in range(n - len(head))],
                    "max_tokens": None,
                    "output_len": output_len(),
                }
            )
    for item in items:
        item["max_tokens"] = item.get("max_tokens") or item.get("output_len") or length_sampler(args.output_len, rng)()
    return items


async def one_request(
    client: AsyncClient, item: dict, t0: float, args, progress, answer: list[int] | None = None
) -> RequestRecord:
    """Sends one request and times it; its generated ids go into `answer` when given."""
    rec = RequestRecord(sent=time.perf_counter() - t0)
    try:
        async for part in client.stream(
            item["prompt"], max_tokens=item["max_tokens"], temperature=args.temperature, ignore_eos=args.ignore_eos
        ):
            if part.token_ids and rec.first_token is None:
                rec.first_token = time.perf_counter() - t0
            rec.num_tokens += len(part.token_ids)
            if answer is not None:
                answer.extend(part.token_ids)
            if part.finished:
                rec.done = time.perf_counter() - t0
                rec.prompt_tokens = part.usage.prompt_tokens
                rec.cached_tokens = part.timings.cached_tokens
                rec.local_prefill = part.timings.local_prefill
    except grpc.aio.AioRpcError as e:
        rec.error = e.code().name
    if rec.done is None and rec.error is None:
        rec.error = "INCOMPLETE"
    if progress is not None:
        progress.update(1)
    return rec


async def one_item(client: AsyncClient, item: dict, t0: float, args, progress) -> list[RequestRecord]:
    """A request, or a conversation: each turn after the previous answer, its prompt the history
    (earlier turns and answers) and the turn; a failed turn ends the conversation."""
    if "turns" not in item:
        return [await one_request(client, item, t0, args, progress)]
    history, records = [], []
    for turn in item["turns"]:
        answer: list[int] = []
        prompt = history + turn
        records.append(
            await one_request(client, {"prompt": prompt, "max_tokens": item["max_tokens"]}, t0, args, progress, answer)
        )
        if not records[-1].ok:
            break
        history = prompt + answer
    return records


def arrival_times(n: int, rate: float, arrival: str, rng: random.Random) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
    return times


async def run_once(args, items: list[dict], rate: float, rng: random.Random) -> tuple[Report, list[RequestRecord]]:
    metadata = [("application", args.application)] if args.application else None
    progress = None
    if not args.quiet:
        from tqdm import tqdm

        progress = tqdm(
            total=sum(len(it.get("turns", [None])) for it in items),
            desc="trace" if args.trace else f"rate {rate:g}" if rate != float("inf") else "requests",
            unit="req",
            file=sys.stderr,
            leave=True,
        )  # left at its final count, not cleared
    async with AsyncClient(args.addr, timeout=args.timeout, metadata=metadata) as client:
        t0 = time.perf_counter()
        if args.rate is None and not args.trace:  # closed loop
            queue = list(items)
            records: list[RequestRecord] = []

            async def worker():
                while queue:
                    records.extend(await one_item(client, queue.pop(0), t0, args, progress))

            await asyncio.gather(*(worker() for _ in range(args.concurrency or 1)))
        else:  # open loop, optionally capped
            limit = asyncio.Semaphore(args.concurrency) if args.concurrency else None

            async def scheduled(item, at):
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                if limit is None:
                    return await one_item(client, item, t0, args, progress)
                async with limit:
                    return await one_item(client, item, t0, args, progress)

            times = [it["at"] for it in items] if args.trace else arrival_times(len(items), rate, args.arrival, rng)
            records = [
                r for rs in await asyncio.gather(*(scheduled(it, at) for it, at in zip(items, times))) for r in rs
            ]
        duration = time.perf_counter() - t0
    if progress is not None:
        progress.close()
    return report(records, duration, args.slo_ttft, args.slo_tpot), records


async def bench(args, requests: list[trace.TraceRequest] | None = None) -> list[dict]:
    rng = random.Random(args.seed)
    print(f"workload seed {args.seed} (--seed {args.seed} sends the same prompts again)", flush=True)
    metadata = [("application", args.application)] if args.application else None
    async with AsyncClient(args.addr, timeout=args.timeout, metadata=metadata) as client:
        items = await build_workload(client, args, rng, requests)
    rates = [float(r) for r in args.rate.split(",")] if args.rate else [float("inf")]
    runs = []
    for rate in rates:
        rep, records = await run_once(args, items, rate, rng)
        label = (
            f"[trace {args.trace}, x{args.trace_speedup:g}] "
            if args.trace
            else f"[rate {rate:g} req/s] "
            if args.rate
            else f"[closed loop, concurrency {args.concurrency or 1}] "
        )
        print(format_report(rep, label), flush=True)
        runs.append(
            {
                "rate": rate if rate != float("inf") else None,
                "report": rep.to_dict(),
                "records": [r.__dict__ for r in records],
            }
        )
    return runs


def add_args(p) -> None:
    p.add_argument("--addr", required=True, help="HOST:PORT of a pdserve router (or Ray Serve proxy)")
    p.add_argument(
        "--num-requests",
        type=int,
        default=64,
        help="requests (or conversations, from a multi-turn dataset) per rate, or in the closed loop "
        "(a --trace sends all of its own)",
    )
    p.add_argument(
        "--rate", default=None, help="requests/s (open loop); 'inf' sends all at once; a comma-separated list sweeps"
    )
    p.add_argument(
        "--arrival", choices=["poisson", "constant"], default="poisson", help="inter-arrival times at a --rate"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop without --rate; with --rate, a cap on requests in flight",
    )
    p.add_argument("--prompt-len", default="uniform:200:400", help="N, uniform:A:B or normal:MEAN:STD tokens")
    p.add_argument("--output-len", default="128", help="N, uniform:A:B or normal:MEAN:STD tokens")
    p.add_argument(
        "--dataset",
        help="JSONL of prompts: {'prompt': text} or {'prompt_token_ids': [...]}, "
        "optional 'max_tokens'; or multi-turn conversations: a list of turns, "
        "{'turns': [...]}, or {'conversation_id': id, 'turn': k, 'prompt': ...} "
        "per line (each turn is sent after the previous answer, with the history)",
    )
    trace.add_args(p)
    add_temperature(p)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="stop at EOS (default: generate exactly the output length)",
    )
    p.add_argument("--slo-ttft", type=float, default=None, help="seconds; goodput counts requests within it")
    p.add_argument("--slo-tpot", type=float, default=None, help="seconds per output token")
    p.add_argument("--json", help="write the reports (and per-request records) here")
    p.add_argument("--plot", help="write PNG plots into this directory")
    p.add_argument("--application", help="Ray Serve application name (metadata through Serve's proxy)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in seconds")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the workload's draws (prompts, lengths, arrivals) (default: a new one each run, "
        "printed: the same prompts again would hit the server's prefix cache)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    requests = None
    if args.trace:
        if args.rate or args.dataset or args.concurrency is not None:
            raise ValueError("--trace sets the arrivals and the prompts: leave out --rate, --concurrency and --dataset")
        requests = trace.read(args.trace, args.trace_speedup, args.trace_block_tokens)  # named before connecting
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)  # recorded in --json's args
    runs = asyncio.run(bench(args, requests))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"}, "runs": runs}, indent=2)
        )
    if args.plot:
        from pdserve.bench_plot import plot

        for path in plot(runs, Path(args.plot)):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r["report"]["completed"] for r in runs) else 1
