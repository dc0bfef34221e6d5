"""Random mixes of requests, the features together: speculation, n > 1 and best_of, beam search,
seeds, stop strings and stop tokens, logprobs, shared prefixes and multi-turn follow-ups, a KV pool
small enough that preemption and eviction happen, cancellations. A mix runs through one engine (or a
cluster, tests/test_combinations.py) and every finished request must equal the same request run
alone on a fresh engine, in fp32; nothing may be left holding a block.

The fast fixed-seed set runs in `make test`; the long soak is

    .venv/bin/python tests/combinations.py --seeds 200 --json docs/bench/combinations.json

(docs/reliability.md has its figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import engine_config  # noqa: E402

from engine import LLMEngine, SamplingParams  # noqa: E402
from engine.structured_output import StructuredOutput  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
STRUCTURED = [
    StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "yz"]}}})),
    StructuredOutput("regex", "[a-z]{2,8}( [a-z]{2,8})*"),
    StructuredOutput("choice", '["yes", "no", "not sure"]'),
]
VOCAB = range(10, 250)
HANG_S = float(
    os.environ.get("PDSERVE_HANG_S", 600)
)  # guards against a hang, never a timing  # ids the tiny test models know (their vocabulary is 256 + specials)


@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrive: int = 0  # engine step at which it is added (follow-ups: steps after their parent finished)
    cancel_after: int | None = None  # steps after arriving at which it is cancelled
    parent: str | None = None  # a follow-up turn: parent's prompt + its answer (sample 0) + new tokens
    turn: list[int] = field(default_factory=list)

    @property
    def kinds(self) -> set[str]:
        p = self.params
        kinds = {"beam" if p.beam_width > 1 else "n>1" if p.num_samples > 1 else "greedy" if p.greedy else "seeded"}
        kinds |= {
            k
            for k, on in (
                ("stop", p.stop),
                ("stop_ids", p.stop_token_ids),
                ("logprobs", p.logprobs),
                ("penalized", p.penalized or p.min_p),
                ("structured", p.structured_output),
                ("follow-up", self.parent),
                ("cancel", self.cancel_after is not None),
            )
            if on
        }
        return kinds


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "greedy", "seeded", "seeded", "n", "beam"])
    max_tokens = rng.randint(1, 20)
    common = {
        "max_tokens": max_tokens,
        "ignore_eos": rng.random() < 0.7,
        "stop_token_ids": tuple(rng.sample(VOCAB, 2)) if rng.random() < 0.2 else (),
    }
    if rng.random() < 0.3:
        common["logprobs"] = rng.randint(0, 3)
    stop = tuple(rng.sample("abcdefghijklmnopqrstuvwxyz ", 2)) if rng.random() < 0.25 else ()
    if kind == "beam":
        width = rng.randint(2, 3)
        if rng.random() < 0.2:  # each beam in its own grammar
            common |= {"ignore_eos": False, "structured_output": rng.choice(STRUCTURED)}
        return SamplingParams(beam_width=width, n=rng.randint(1, width), temperature=0, **common)
    if rng.random() < 0.15:  # structured output (takes no ignore_eos, min_tokens or bad words)
        common |= {"ignore_eos": False, "structured_output": rng.choice(STRUCTURED)}
    elif rng.random() < 0.3:  # penalties, biases, min_p, min_tokens, bad words (engine/penalties.py)
        common |= rng.choice(
            [
                {"presence_penalty": 1.5},
                {"frequency_penalty": 0.75, "repetition_penalty": 1.25},
                {"logit_bias": {rng.choice(VOCAB): 5.0, rng.choice(VOCAB): -100.0}},
                {"min_tokens": min(3, max_tokens), "min_p": 0.25},
                {"bad_words_token_ids": ((rng.choice(VOCAB),), tuple(rng.sample(VOCAB, 2)))},
            ]
        )
    sampling = (
        {"temperature": 0}
        if kind == "greedy"
        else {
            "temperature": rng.choice([0.5, 1.0]),
            "top_k": rng.choice([0, 5, 50]),
            "top_p": rng.choice([1.0, 0.9]),
            "seed": rng.randrange(1 << 30),
        }
    )
    if kind == "n":
        n = rng.randint(2, 3)
        best_of = rng.choice([None, n + 1])
        return SamplingParams(n=n, best_of=best_of, stop=stop, **sampling, **common)
    return SamplingParams(stop=stop, **sampling, **common)


def random_workload(rng: random.Random, num_requests: int) -> list[Req]:
    """Prompts from a few shared prefixes (a system prompt, repeated text that n-gram drafts copy)
    plus their own tokens; some requests are follow-up turns of earlier ones; some are cancelled."""
    prefixes = [[rng.choice(VOCAB) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    prefixes.append([11, 12, 13, 14, 15] * 3)  # repeats itself: drafts are proposed and accepted
    reqs: list[Req] = []
    for i in range(num_requests):
        params = random_params(rng)
        if reqs and rng.random() < 0.25:  # a next turn of an earlier request
            parent = rng.choice(reqs)
            reqs.append(
                Req(
                    f"r{i}",
                    [],
                    params,
                    parent=parent.rid,
                    arrive=rng.randint(0, 3),
                    turn=[rng.choice(VOCAB) for _ in range(rng.randint(1, 6))],
                )
            )
            continue
        prompt = rng.choice(prefixes + [[]]) + [rng.choice(VOCAB) for _ in range(rng.randint(1, 12))]
        cancel = rng.randint(0, 6) if rng.random() < 0.12 else None
        reqs.append(Req(f"r{i}", prompt, params, arrive=rng.randint(0, 12), cancel_after=cancel))
    return reqs


def random_engine(rng: random.Random) -> dict:
    """Engine settings for a mix: a small pool (preemption, eviction), small steps (chunked
    prefill), prefix caching mostly on, prompts beside decodes in small chunks or not (speculation:
    engine_mix)."""
    return {
        "num_kv_blocks": rng.choice([32, 48, 64]),
        "max_num_batched_tokens": rng.choice([16, 32, 512]),
        "max_num_seqs": rng.choice([4, 8, 64]),
        "enable_prefix_caching": rng.random() < 0.85,
        "prefill_tokens_with_decodes": rng.choice([0, 0, 5]),  # prompts beside decodes: a share of the step
    }


def speculation(model, seed: int, reference: Reference) -> dict | None:
    """By the seed, a third of the mixes each: none, n-gram drafts (accepted where a random model
    happens to repeat what the prompt repeats), the model drafting for itself (its greedy drafts
    accepted whatever the model; deterministic mode refuses a draft model: n-gram there)."""
    drafts = {"method": "draft_model", "draft_model": str(model), "num_speculative_tokens": 3}
    return [None, NGRAM, NGRAM if reference.numerics else drafts][seed % 3]


def make_engine(model, **kwargs) -> LLMEngine:
    return LLMEngine(engine_config(model, **kwargs))  # fp32 on the CPU, the tests' small blocks


def step_outputs(engine: LLMEngine, outs: dict) -> list[str]:
    """One step: each sample's latest output kept by (request, index); returns the requests done."""
    done = []
    for out in engine.step():
        outs[out.request_id, out.index] = out
        if out.last:
            done.append(out.request_id)
    return done


def result(outs: dict, rid: str) -> list[tuple]:
    """What a request returned, comparable: per sample (index, tokens, text, finish reason, logprobs)."""
    return [
        (i, o.token_ids, o.text, o.finish_reason, o.logprobs)
        for (r, i), o in sorted(outs.items(), key=lambda kv: kv[0][1])
        if r == rid
    ]


@dataclass
class Reference:
    """What a mix's answers must equal: each request run alone on a fresh engine of these numerics
    (no speculation, a pool that holds it), kept by prompt and params. In fp32 logprobs agree to
    1e-4 (the kernels sum in batch order); in deterministic mode exactly, in either dtype."""

    numerics: dict = field(default_factory=dict)  # engine settings of every engine, e.g. {"deterministic": True}
    logprob_tolerance: float = 1e-4
    runs: dict = field(default_factory=dict)

    @classmethod
    def deterministic(cls, dtype: str) -> Reference:
        return cls({"dtype": dtype, "deterministic": True}, 0.0)


def run_alone(model, prompt: list[int], params: SamplingParams, numerics: dict) -> list[tuple]:
    """The request on a fresh engine of its own (no speculation, a pool that holds it)."""
    engine = make_engine(model, **numerics)
    engine.add_request("alone", prompt, params)
    outs: dict = {}
    while engine.has_unfinished():
        step_outputs(engine, outs)
    return result(outs, "alone")


def references(model, reqs: list[Req], reference: Reference) -> None:
    """Each request run alone (kept in reference by prompt and params). A follow-up turn's prompt
    is its parent's prompt, the parent's answer alone (sample 0: what the mix must give too) and
    its own new tokens."""
    by_id = {r.rid: r for r in reqs}
    for r in reqs:
        if r.parent:
            parent = by_id[r.parent]
            r.prompt = parent.prompt + list(reference.runs[tuple(parent.prompt), parent.params][0][1]) + r.turn
        if (tuple(r.prompt), r.params) not in reference.runs:
            reference.runs[tuple(r.prompt), r.params] = run_alone(model, r.prompt, r.params, reference.numerics)


def same(got: list[tuple], want: list[tuple], logprobs: bool = True, tolerance: float = 1e-4) -> bool:
    """Tokens, text and finish reasons exactly; logprobs (when asked for) within tolerance."""
    if [g[:4] for g in got] != [w[:4] for w in want]:
        return False
    for g, w in zip(got, want):
        if not logprobs:
            break
        if (g[4] is None) != (w[4] is None):
            return False
        for a, b in zip(g[4] or [], w[4] or []):
            if a.keys() != b.keys() or any(abs(a[t] - b[t]) > tolerance for t in a):
                return False
    return True


@dataclass
class Report:
    seeds: int = 0
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    refused: int = 0  # beam search without prefix caching: refused at add_request, naming why
    wrong: list = field(default_factory=list)
    leaked: list = field(default_factory=list)
    kinds: dict = field(default_factory=dict)
    preemptions: int = 0
    cache_hit_tokens: int = 0
    evicted_blocks: int = 0
    spec_accepted: int = 0
    prefix_waits: int = 0  # prompts held back for a block another prefill was computing
    kills: int = 0
    failed_on_kill: int = 0  # n > 1 or beams that had streamed on the killed node (they do not migrate)
    clusters: dict = field(default_factory=dict)  # "kv_transport, local prefill mode" -> mixes

    def add_kinds(self, req: Req) -> None:
        for k in req.kinds:
            self.kinds[k] = self.kinds.get(k, 0) + 1


def engine_mix(model, seed: int, num_requests: int, report: Report, reference: Reference) -> None:
    """One mix through one engine; every finished request checked against its run alone."""
    rng = random.Random(seed)
    reqs, settings = random_workload(rng, num_requests), random_engine(rng)
    settings["speculative"] = speculation(model, seed, reference)
    if seed % 3 == 0:  # a third of the mixes under pressure whatever else was drawn: preemptions, evictions
        settings |= {"num_kv_blocks": 32, "max_num_seqs": 64, "max_num_batched_tokens": 512}
    references(model, reqs, reference)
    engine = make_engine(model, **settings, **reference.numerics)
    outs, done_at, added, aborted, refused, step = {}, {}, {}, set(), set(), 0
    waiting = list(reqs)
    while waiting or engine.has_unfinished():
        for r in list(waiting):  # a follow-up arrives its `arrive` steps after its parent ended
            start = r.arrive if r.parent is None else done_at.get(r.parent, 1 << 30) + r.arrive
            if start <= step:
                waiting.remove(r)
                try:
                    engine.add_request(r.rid, r.prompt, r.params)
                except ValueError as e:  # a combination refused up front, by name (documented)
                    if not (r.params.beam_width > 1 and not settings["enable_prefix_caching"]):
                        raise
                    assert "beam search needs enable_prefix_caching" in str(e)
                    refused.add(r.rid)
                    done_at[r.rid] = step
                    continue
                added[r.rid] = step
        for r in reqs:
            if r.cancel_after is not None and added.get(r.rid) == step - r.cancel_after and r.rid not in done_at:
                engine.abort_request(r.rid)
                aborted.add(r.rid)
                done_at[r.rid] = step
        for rid in step_outputs(engine, outs):
            done_at[rid] = step
        step += 1
        if step > 20_000:
            raise AssertionError(f"seed {seed}: the engine did not finish")
    report.seeds += 1
    report.requests += len(reqs)
    report.cancelled += len(aborted)
    report.refused += len(refused)
    for r in reqs:
        report.add_kinds(r)
        if r.rid in aborted or r.rid in refused:
            continue
        report.finished += 1
        got, want = result(outs, r.rid), reference.runs[tuple(r.prompt), r.params]
        if not same(got, want, r.params.logprobs is not None, reference.logprob_tolerance):
            report.wrong.append(
                {
                    "seed": seed,
                    "request": r.rid,
                    "kinds": sorted(r.kinds),
                    "settings": str(settings),
                    "got": [g[1:5] for g in got],
                    "want": [w[1:5] for w in want],
                }
            )
    bm = engine.block_manager
    left = {
        "blocks": bm.num_used_blocks,
        "requests": len(engine.requests),
        "groups": len(engine.groups),
        "beams": len(engine.beams),
        "leases": len(engine.kv_leases),
    }
    if any(left.values()):
        report.leaked.append({"seed": seed, **left})
    count_work(report, engine)


def count_work(report: Report, engine: LLMEngine) -> None:
    """What a mix made an engine do: preemptions, prefix-cache hits and evictions, accepted drafts,
    prompts that waited for a prefix another prefill was computing."""
    bm = engine.block_manager
    report.preemptions += engine.scheduler.num_preemptions
    report.cache_hit_tokens += bm.num_hit_tokens
    report.evicted_blocks += bm.num_evicted_blocks
    report.spec_accepted += engine.num_accepted_tokens
    report.prefix_waits += engine.scheduler.num_prefix_waits


def random_cluster(rng: random.Random) -> dict:
    """Cluster settings for a mix: a small decode pool, their local prefills' chunks beside
    decodes, a TPOT bound on local prefills (a tiny model's tokens come a few ms apart: some
    start, some do not). The KV's way across, where prefills run, speculation and whether a
    decode node is killed mid-run: by the seed (cluster_mix)."""
    return {
        "num_kv_blocks": rng.choice([32, 48]),
        "prefill_tokens_with_decodes": rng.choice([None, 5]),  # the decode node's default, or small chunks
        "max_local_prefill_tpot": rng.choice([None, 0.005]),
    }


def nodes_state(nodes) -> list[dict]:
    """Where each node's engine stands (a hang's report)."""
    states = []
    for node in nodes:
        engine = node.llm
        sched, bm = engine.scheduler, engine.block_manager
        states.append(
            {
                "address": node.address,
                "running": [(s.request_id, s.index, s.num_tokens, len(s.block_table)) for s in sched.running],
                "waiting": [
                    (s.request_id, s.index, s.num_tokens, s.num_computed_tokens, len(s.block_table))
                    for s in sched.waiting
                ],
                "free_blocks": bm.num_free_blocks,
                "used_blocks": bm.num_used_blocks,
                "kv_leases": len(engine.kv_leases),
                "groups": list(engine.groups),
                "beams": list(engine.beams),
                "engine_alive": not getattr(node.engine, "dead", False),
            }
        )
    return states


def completion_result(c) -> list[tuple]:
    """A cluster's answer in the form of result(): per sample (index, tokens, text, reason, logprobs)."""
    return [(i, s.token_ids, s.text, s.finish_reason, s.logprobs or None) for i, s in enumerate(c.samples)]


async def cluster_mix(model, seed: int, num_requests: int, report: Report, reference: Reference) -> None:
    """One mix through a router, a prefill node and two decode nodes (real gRPC servers on
    localhost); with `kill`, a decode node stops abruptly once a third of the requests are in.
    Requests on it migrate (same tokens); n > 1 and beams that already streamed end UNAVAILABLE
    naming the decode failure (they forked on that node: docs/reliability.md)."""
    import asyncio

    from cluster import local_cluster, wait_for_no_blocks

    from kvtransfer.shm import PREFIX as SHM_PREFIX
    from kvtransfer.shm import SHM_DIR
    from pdserve_api import common_pb2, generate_pb2
    from router.client import AsyncClient, Completion
    from serving.protocol import sampling_to_proto

    rng = random.Random(seed)
    reqs, settings = random_workload(rng, num_requests), random_cluster(rng)
    settings["speculative"] = speculation(model, seed, reference)  # on the decode nodes
    # by the seed too, so that any 4 consecutive seeds cover every way and kill in two of them
    way = [("shm", "off"), ("tcp", "off"), ("shm", "auto"), ("tcp", "auto")][seed % 4]
    settings |= {"kv_transport": way[0], "local_prefill": way[1], "kill": seed % 2 == 0}
    references(model, reqs, reference)
    decode_engine = {k: settings[k] for k in ("num_kv_blocks", "speculative", "prefill_tokens_with_decodes")}
    decode_engine |= reference.numerics
    way = f"{settings['kv_transport']}, local prefill {settings['local_prefill']}"
    report.clusters[way] = report.clusters.get(way, 0) + 1
    done: dict[str, asyncio.Event] = {r.rid: asyncio.Event() for r in reqs}
    answers: dict[str, object] = {}
    async with local_cluster(
        model,
        num_decode=2,
        prefill_engine=reference.numerics,
        decode_engine=decode_engine,
        kv_transport=settings["kv_transport"],
        local_prefill=settings["local_prefill"],
        max_local_prefill_tpot=settings["max_local_prefill_tpot"],
    ) as (router, prefills, decodes):
        killed = asyncio.Event()

        async def one(r: Req, client: AsyncClient) -> None:
            try:
                await asyncio.sleep(r.arrive * 0.01)
                if r.parent:
                    await done[r.parent].wait()
                request = generate_pb2.GenerateRequest(
                    prompt_token_ids=common_pb2.TokenIds(ids=r.prompt), sampling=sampling_to_proto(r.params)
                )
                result, parts = Completion(), 0
                call = client.stub.Generate(request)
                async for part in call:
                    result.add(part)
                    parts += 1
                    if r.cancel_after is not None and parts > r.cancel_after:
                        call.cancel()
                        answers[r.rid] = "cancelled"
                        return
                answers[r.rid] = result
            except Exception as e:  # noqa: BLE001 - every outcome is judged below
                answers[r.rid] = e
            finally:
                done[r.rid].set()

        async def killer() -> None:
            while sum(e.is_set() for e in done.values()) < len(reqs) // 3:
                await asyncio.sleep(0.005)
            await decodes[1].stop(0)  # abruptly: its streams break mid-way
            killed.set()

        async with AsyncClient(router.server.address) as client:
            tasks = [asyncio.ensure_future(one(r, client)) for r in reqs]
            if settings["kill"]:
                tasks.append(asyncio.ensure_future(killer()))
                report.kills += 1
            finished, pending = await asyncio.wait(tasks, timeout=HANG_S)
            if pending:  # a hang: say where every node stands, then give up on the mix
                report.wrong.append(
                    {
                        "seed": seed,
                        "hung": [r.rid for r in reqs if not done[r.rid].is_set()],
                        "settings": str(settings),
                        "nodes": nodes_state(prefills + decodes),
                    }
                )
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        alive = prefills + decodes[:1] if settings["kill"] else prefills + decodes
        try:
            await wait_for_no_blocks(alive, timeout=HANG_S)
            leases = sum(len(p.llm.kv_leases) for p in prefills)
            if leases:
                report.leaked.append({"seed": seed, "cluster": True, "leases": leases})
        except AssertionError as e:
            report.leaked.append({"seed": seed, "cluster": True, "blocks": str(e)})
        for node in prefills + decodes:
            count_work(report, node.llm)
    regions = [p.name for p in SHM_DIR.glob(f"{SHM_PREFIX}{os.getpid()}-*")]  # every node stopped: none left
    if regions:
        report.leaked.append({"seed": seed, "cluster": True, "shm_regions": regions})
    report.seeds += 1
    report.requests += len(reqs)
    for r in reqs:
        report.add_kinds(r)
        answer = answers.get(r.rid)
        if answer is None:  # hung: reported above
            continue
        if answer == "cancelled":
            report.cancelled += 1
            continue
        if isinstance(answer, Exception):
            details = answer.details() if hasattr(answer, "details") else ""
            forked_on_dead = settings["kill"] and r.params.forks and "do not migrate" in details
            if forked_on_dead:
                report.failed_on_kill += 1
                continue
            report.wrong.append(
                {
                    "seed": seed,
                    "request": r.rid,
                    "kinds": sorted(r.kinds),
                    "settings": str(settings),
                    "error": repr(answer)[:300],
                }
            )
            continue
        report.finished += 1
        got, want = completion_result(answer), reference.runs[tuple(r.prompt), r.params]
        if not same(got, want, r.params.logprobs is not None, reference.logprob_tolerance):
            report.wrong.append(
                {
                    "seed": seed,
                    "request": r.rid,
                    "kinds": sorted(r.kinds),
                    "settings": str(settings),
                    "got": [g[1:5] for g in got],
                    "want": [w[1:5] for w in want],
                }
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=50, help="mixes through one engine")
    ap.add_argument("--cluster-seeds", type=int, default=20, help="mixes through a cluster")
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--deterministic", choices=("bfloat16", "float32"), help="every engine deterministic, in this dtype"
    )
    args = ap.parse_args()
    import asyncio
    import logging
    import tempfile

    from tiny_models import make_tiny_model

    logging.basicConfig(level=logging.ERROR)  # migrations log warnings by design
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="pdserve-combinations-")), "llama")
    reference = Reference.deterministic(args.deterministic) if args.deterministic else Reference()
    report, began = Report(), time.monotonic()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        engine_mix(model, seed, args.requests, report, reference)
    engine_report, report = report, Report()
    for seed in range(args.first_seed, args.first_seed + args.cluster_seeds):
        print(f"cluster seed {seed}", file=sys.stderr, flush=True)
        asyncio.run(cluster_mix(model, seed, args.requests, report, reference))
    out = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.monotonic() - began),
        "engine": dataclasses.asdict(engine_report),
        "cluster": dataclasses.asdict(report),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 1 if any(r.wrong or r.leaked for r in (engine_report, report)) else 0


if __name__ == "__main__":
    sys.exit(main())
