"""Small async streaming load generator for an OpenAI-compatible /v1/completions.

32 requests, ~600-token prompts (a sentence repeated, with a unique per-request
prefix so prefix caching / ExampleConnector dedup can't short-cut them),
max_tokens 64, ignore_eos, temperature 0, stream, concurrency 8.

Usage: bench.py URL [--n 32] [--conc 8] [--tag name] [--out file.json]
"""

import argparse
import asyncio
import json
import statistics
import time

import aiohttp

SENT = "The quick brown fox jumps over the lazy dog near the river bank. "


def make_prompt(i: int, tag: str, reps: int = 43) -> str:
    return f"Request {tag}-{i}: " + SENT * reps


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


MODEL = "smol"  # --model: the served model name (pdserve: its model id)


async def one(session, url, prompt, max_tokens):
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    tok_times = []
    text = []
    usage = None
    async with session.post(url, json=body) as r:
        r.raise_for_status()
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                ev = ev.strip()
                if not ev.startswith(b"data:"):
                    continue
                data = ev[5:].strip()
                if data == b"[DONE]":
                    continue
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices", []):
                    if ch.get("text"):
                        tok_times.append(time.perf_counter())
                        text.append(ch["text"])
    t1 = time.perf_counter()
    return {
        "t0": t0,
        "ttft": tok_times[0] - t0 if tok_times else None,
        "itl": [b - a for a, b in zip(tok_times, tok_times[1:])],
        "e2e": t1 - t0,
        "n_chunks": len(tok_times),
        "completion_tokens": (usage or {}).get("completion_tokens"),
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "text": "".join(text),
    }


async def run(url, n, conc, max_tokens, tag):
    sem = asyncio.Semaphore(conc)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def guarded(i):
            async with sem:
                return await one(s, url, make_prompt(i, tag), max_tokens)

        t0 = time.perf_counter()
        res = await asyncio.gather(*[guarded(i) for i in range(n)])
        wall = time.perf_counter() - t0
    return res, wall


def summarize(res, wall):
    ttft = [r["ttft"] for r in res]
    itl = [x for r in res for x in r["itl"]]
    tpot = [
        (r["e2e"] - r["ttft"]) / (r["completion_tokens"] - 1)
        for r in res
        if r["completion_tokens"] and r["completion_tokens"] > 1
    ]
    out_toks = sum(r["completion_tokens"] or r["n_chunks"] for r in res)
    return {
        "n": len(res),
        "wall_s": wall,
        "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] or 0 for r in res),
        "out_tokens": out_toks,
        "out_tok_s": out_toks / wall,
        "req_s": len(res) / wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p95_ms": 1e3 * pct(ttft, 95),
        "tpot_p50_ms": 1e3 * pct(tpot, 50),
        "tpot_p95_ms": 1e3 * pct(tpot, 95),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p95_ms": 1e3 * pct(itl, 95),
        "itl_p99_ms": 1e3 * pct(itl, 99),  # (added here: the longest stalls between tokens)
        "itl_max_ms": 1e3 * max(itl, default=float("nan")),
        "e2e_p50_s": pct([r["e2e"] for r in res], 50),
        "chunks_per_req_min": min(r["n_chunks"] for r in res),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--conc", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default="smol")
    a = ap.parse_args()
    global MODEL
    MODEL = a.model
    res, wall = asyncio.run(run(a.url, a.n, a.conc, a.max_tokens, a.tag))
    s = summarize(res, wall)
    print(json.dumps(s, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": s, "requests": res}, f)


if __name__ == "__main__":
    main()
