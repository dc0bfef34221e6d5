"""A discrete-event simulator of a pdserve deployment over a measured profile (profile.py).

Engines step as the engine's scheduler does (decoding sequences first, one token each, then
waiting prefills in arrival order, chunked within the token budget, beside decodes within
prefill_tokens_with_decodes, a prefill half of whose uncached tokens another is computing waiting
for them) and each step lasts what the profile's step line says it costs. The router's decisions
are the router's own code, not a copy: `EndpointPool.pick` chooses the decode node (load, then
cached prefix) and the prefill node, `Placement.decide` chooses a local or remote prefill (and holds a
request that would queue behind another local prefill until a prefill ends, as the router does) and
learns from the simulated timings as the router learns from real ones (prefill lines, hand-off,
a decode node's token gaps, which a TPOT bound on local prefills reads), and block names are
`block_hashes`, so a follow-up hits exactly the nodes whose cache holds its history. A remote
prefill's first token goes out when the prefill ends; the decode node admits the sequence after
the profile's hand-off line (the transport's). The records are `pdserve bench`'s, and the report
is bench_stats' (TTFT, TPOT, goodput). The step line is timed decoding greedily; a workload with a
temperature adds what the profile measured sampling to cost, per token a step emits.

Arrival timing: by default a request reaches its engine exactly router_s after it is sent, and
an idle engine starts its step at once. In a real deployment the serving thread and the engine's
step thread share one interpreter, so each is late by up to CPython's switch interval (5 ms),
and which of the prompts sent together make an idle engine's first step varies from run to run
(1 to 6 of the anchor's 8 in the colocated runs of docs/bench/plan_accuracy_repeats_r*.json). In
a closed loop that first step sets which requests finish together for the rest of the run, and
so its latencies. With a timing seed both delays are drawn from U(0, ARRIVAL_JITTER_S): a request's
arrival at the engine that prefills it, and an idle engine's start (a sequence handed off to a
decode node is admitted after the hand-off line, which was measured through that node's serving
thread); `timing_spread` summarizes the runs of several seeds.

Engines on one host share its memory bandwidth: a decode step that begins while another engine
is in a step that decodes costs the profile's contention figure times its line (measured with one
other engine; the engines' steps are alike in that, whatever their batch), where the deployment's
cores fit the profiled machine (beyond it, which engines share a host is not known).

Not modelled: preemption (the KV is assumed to fit), speculative decoding, n > 1 and beams,
failures, and the step-to-step noise of a shared machine.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import random
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import DECODE_NODE_PREFILL_TOKENS
from engine.scheduler import waits_for_prefix
from pdserve import trace
from pdserve.bench import arrival_times, length_sampler
from pdserve.bench_stats import Report, RequestRecord, report
from pdserve.plan.step_model import Step, StepModel, shared_tokens
from pdserve_api import common_pb2
from router.placement import MAX_LOCAL_TOKENS, Placement
from router.pool import Endpoint, EndpointPool, block_hashes

ARRIVAL_JITTER_S = 0.005  # CPython's default switch interval (sys.getswitchinterval()): see above


# ---- what is simulated --------------------------------------------------------------------------
@dataclass(frozen=True)
class Deployment:
    """colocated engines, or prefill + decode nodes, each engine with its own threads."""

    name: str
    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    threads: int = 1  # per engine
    local_prefill: str = "auto"  # the router's placement mode (colocated: always)
    max_local_tokens: int = MAX_LOCAL_TOKENS
    late_binding: bool = True  # the router's option
    max_local_tpot: float | None = None  # the router's max_local_prefill_tpot (seconds)
    prefill_tokens_with_decodes: int | None = None  # the engine option (None: the node kind's default)
    transport: str = "shm"  # a key of the profile's handoff
    gpu: bool = False  # each engine on a GPU of its own (a GPU's profile)

    @property
    def engines(self) -> int:
        return self.colocated + self.prefill + self.decode

    @property
    def cores(self) -> int:
        return self.threads * self.engines

    @property
    def single_process(self) -> bool:
        """One colocated engine runs as `pdserve colocated`: its serving threads in the engine's
        process, on its cores (no router, whose share of TTFT is still counted: a few ms)."""
        return self.colocated == 1

    @property
    def spends(self) -> int:
        """What it takes of a budget: GPUs (one an engine), or cores (each engine its threads')."""
        return self.engines if self.gpu else self.cores

    def describe(self) -> str:
        each = "1 GPU" if self.gpu else f"{self.threads} thread(s)"
        beside = (
            ""
            if self.prefill_tokens_with_decodes is None
            else f", {self.prefill_tokens_with_decodes} prompt tokens a step beside decodes"
        )
        if self.colocated:
            return f"{self.colocated} colocated x {each}{beside}"
        return (
            f"{self.prefill}P{self.decode}D x {each}, local prefill {self.local_prefill}"
            + (f" (<= {self.max_local_tokens} tokens)" if self.local_prefill == "auto" else "")
            + ("" if self.late_binding or self.local_prefill != "auto" else ", bound on arrival")
            + (
                f", none while TPOT > {self.max_local_tpot * 1e3:.0f} ms"
                if self.max_local_tpot is not None and self.local_prefill == "auto"
                else ""
            )
            + f", {self.transport}{beside}"
        )


@dataclass
class Item:
    turns: list[list[int]]  # one prompt, or a conversation's turns (each after the last answer)
    output_len: int


@dataclass
class Workload:
    items: list[Item]
    concurrency: int | None = None  # closed loop: workers
    rate: float | None = None  # open loop: items per second (Poisson)
    seed: int = 0
    times: list[float] | None = None  # a trace's arrivals (seconds), one per item, instead of either loop
    temperature: float = 0.0  # every request's (0: greedy, as the profile's steps; top-k and top-p off)


def synthetic(num: int, prompt_len: str, output_len: str, seed: int = 0, **loop) -> Workload:
    """Prompts of random tokens (no shared prefix), as `pdserve bench` builds them."""
    rng = random.Random(seed)
    plen, olen = length_sampler(prompt_len, rng), length_sampler(output_len, rng)
    items = [Item([[rng.randrange(1, 1 << 30) for _ in range(plen())]], olen()) for _ in range(num)]
    return Workload(items, seed=seed, **loop)


def conversations(turns: list[list[list[int]]], answer_len: int, **loop) -> Workload:
    return Workload([Item(t, answer_len) for t in turns], **loop)


def traced(requests: list[trace.TraceRequest], block_tokens: int = trace.BLOCK_TOKENS, seed: int = 0) -> Workload:
    """A trace's requests (pdserve/trace.py) at its times, their blocks shared as the trace says."""
    ids = trace.prompts(requests, block_tokens, lambda rng: rng.randrange(1, 1 << 30), seed)
    items = [Item([prompt], r.output_length) for prompt, r in zip(ids, requests)]
    return Workload(items, seed=seed, times=[r.at_s for r in requests])


# ---- engines ------------------------------------------------------------------------------------
@dataclass
class Prefill:
    tokens: list[int]
    names: list[int]
    on_done: Callable[[float, int], None]  # (time, tokens its cache held)
    cached: int | None = None
    computed: int = 0


@dataclass
class Decoding:
    tokens: list[int]  # the KV's tokens so far
    left: int  # tokens still to generate
    on_token: Callable[[float, bool], None]  # (time, last)
    names: list[int] = field(default_factory=list)  # its prompt's blocks (block_hashes): a common prefix's are shared
    streamed_at: float | None = None  # its decode node's last token (the router measures the gaps after it)


@dataclass
class Request:  # one request between the router's steps
    prompt: list[int]
    rec: RequestRecord
    seq: Decoding
    names: list[int]  # its prompt's blocks (block_hashes)
    decode: Endpoint  # the decode node picked for it
    decoding: contextlib.ExitStack  # decode.track(), until its last token


class Engine:
    def __init__(
        self,
        sim: Simulation,
        name: str,
        model: StepModel,
        budget: int,
        capacity: int,
        prefill_node: bool = False,
        served: dict | None = None,
        prefill_with_decodes: int = 0,
    ):
        self.sim, self.model, self.budget, self.capacity = sim, model, budget, capacity
        self.prefill_with_decodes = prefill_with_decodes  # the engine's prefill_tokens_with_decodes
        self.prefill_node = prefill_node
        self.served = served  # what serving adds to its prefills, where the profile measured it (profile.py)
        self.endpoint = Endpoint(name, None, None, healthy=True, load=common_pb2.NodeLoad(block_size=sim.block_size))
        self.waiting: deque[Prefill] = deque()
        self.running: list[Decoding] = []
        self.cache: OrderedDict[int, None] = OrderedDict()  # block names, least recently used first
        self.busy_s = 0.0
        self.stepping = self.waking = False
        self.decoding = False  # its step in flight decodes (another engine's decode step beside it pays contention)

    def add_prefill(self, job: Prefill) -> None:
        self.waiting.append(job)
        self.kick()

    def add_decoding(self, seq: Decoding) -> None:
        self.running.append(seq)
        self.kick()

    def cached_tokens(self, names: list[int], num_tokens: int) -> int:
        n = 0
        while n < len(names) and names[n] in self.cache:
            self.cache.move_to_end(names[n])
            n += 1
        return min(n * self.sim.block_size, num_tokens - 1)

    def remember(self, names: list[int]) -> None:
        """Names blocks as computed here (the node's cache report, which the router follows)."""
        cache, reported = self.cache, self.endpoint.cached
        for name in names:
            cache[name] = None
            cache.move_to_end(name)
            reported.add(name)
        while len(cache) > self.capacity:
            reported.discard(cache.popitem(last=False)[0])

    def kick(self) -> None:
        """Work arrived: an idle engine starts a step, as late as its thread wakes (see above)."""
        if self.stepping or self.waking or not (self.waiting or self.running):
            return
        late = self.sim.late()
        if not late:
            self._step()
            return
        self.waking = True
        self.sim.at(self.sim.now + late, self._woken)

    def _woken(self) -> None:
        self.waking = False
        self._step()

    def _step(self) -> None:
        if self.stepping or not (self.waiting or self.running):
            return
        decodes = list(self.running)
        budget = self.budget - len(decodes)
        if self.prefill_with_decodes and decodes:
            budget = min(budget, self.prefill_with_decodes)
        chunks = []
        bs = self.sim.block_size
        computing = {name for j in self.waiting if j.cached is not None for name in j.names[j.computed // bs :]}
        for job in self.waiting:
            if budget <= 0:
                break
            if job.cached is None:
                cached = self.cached_tokens(job.names, len(job.tokens))
                if waits_for_prefix(job.names[cached // bs :], computing, bs, len(job.tokens) - cached):
                    continue  # the engine's rule: it waits for the prefills computing its prefix
                job.cached = job.computed = cached
                computing.update(job.names[cached // bs :])
            n = min(len(job.tokens) - job.computed, budget)
            chunks.append((job, n))
            budget -= n
        prefills = [(n, j.computed) for j, n in chunks]
        shared = self._shared_tokens(decodes) if self.model.per_distinct else 0
        ending = sum(j.computed + n == len(j.tokens) for j, n in chunks)
        contended = bool(decodes) and not chunks and any(e.decoding for e in self.sim.engines if e is not self)
        seconds = self.step_seconds(
            Step(prefills, [len(s.tokens) for s in decodes], shared), ending, contended=contended
        )
        self.stepping, self.decoding = True, bool(decodes)
        self.busy_s += seconds
        self.sim.at(self.sim.now + seconds, lambda: self._step_done(decodes, chunks))

    def step_seconds(self, step: Step, ending: int, streams: int | None = None, contended: bool = False) -> float:
        """A step's seconds: the step line (a decode step's times the contention figure when
        `contended`: it began beside another engine's decoding), what serving adds to a step that
        streams tokens, and what it adds to prompts (a share of their line, and seconds per prompt
        that ends here; on a prefill node, more with the streams decoding elsewhere: by default the
        simulation's)."""
        seconds = self.model.seconds(step)
        if contended and self.sim.contention and not step.prefills:
            seconds *= self.sim.contention
        rows = len(step.decodes) + ending  # the tokens the step samples
        if self.sim.sampling and rows:
            seconds += self.sim.sampling["fixed_s"] + self.sim.sampling["per_row_s"] * rows
        if step.decodes:
            seconds += self.sim.serving["fixed_s"] + self.sim.serving["per_sequence_s"] * len(step.decodes)
        if step.prefills and self.served:
            # (on a prefill node the share grows with the streams decoding elsewhere: the router relays them;
            # a colocated step that also decodes pays both figures, whose per-step parts may overlap: ms)
            if streams is None:
                streams = sum(len(e.running) for e in self.sim.decodes)
            share = self.served["fixed"] + self.served["per_sequence"] * (streams if self.prefill_node else 0)
            seconds += share * self.model.seconds(Step(step.prefills, []))
            seconds += self.served.get("fixed_s", 0.0) * ending
        return seconds

    def _shared_tokens(self, decodes: list[Decoding]) -> int:
        """Block names are chained hashes: sequences share a block only if they share their first."""
        firsts = [seq.names[0] for seq in decodes if seq.names]
        if len(firsts) == len(set(firsts)):
            return 0
        return shared_tokens([seq.names for seq in decodes], self.sim.block_size)

    def _step_done(self, decodes: list[Decoding], chunks: list[tuple[Prefill, int]]) -> None:
        now = self.sim.now  # still stepping: what its results add (a sequence, a prefill) waits for the next step
        for seq in decodes:
            if seq.streamed_at is not None:
                self.endpoint.token_gaps.add(now - seq.streamed_at)
            seq.streamed_at = now
            seq.left -= 1
            seq.tokens.append(self.sim.token())
            if seq.left <= 0:
                self.running.remove(seq)
                self.remember(block_hashes(seq.tokens[:-1], self.sim.block_size))
            seq.on_token(now, seq.left <= 0)
        for job, n in chunks:
            job.computed += n
            if job.computed == len(job.tokens):
                self.waiting.remove(job)
                self.remember(job.names)
                job.on_done(now, job.cached)
            else:  # the engine names a chunk's full blocks as it computes them
                self.remember(job.names[: job.computed // self.sim.block_size])
        self.endpoint.load.num_waiting, self.endpoint.load.num_running = len(self.waiting), len(self.running)
        self.stepping = self.decoding = False
        self._step()  # the engine's loop goes on without waking


# ---- the run --------------------------------------------------------------------------------------
class Simulation:
    def __init__(
        self,
        profile: dict,
        deployment: Deployment,
        slo_ttft: float | None,
        slo_tpot: float | None,
        timing_seed: int | None = None,
    ):
        engines = profile["engines"]
        key = str(deployment.threads)
        if key not in engines:
            raise ValueError(f"the profile has engines of {sorted(engines, key=int)} threads, not {deployment.threads}")
        eng = engines[key]
        self.block_size, self.deployment = eng["block_size"], deployment
        self.slo = (slo_ttft, slo_tpot)
        model, budget, capacity = StepModel(**eng["step"]), eng["max_num_batched_tokens"], eng["num_kv_blocks"]
        if deployment.transport not in profile["handoff"] and not deployment.colocated:
            raise ValueError(
                f"the profile measured no {deployment.transport!r} hand-off (it has {sorted(profile['handoff'])})"
            )
        self.handoff = profile["handoff"].get(deployment.transport, {"fixed_s": 0.0, "per_token_s": 0.0})
        # the reads that leave out the blocks the decode node holds (their Capabilities' partial)
        self.partial = deployment.transport.split("-")[0] in ("shm", "tcp")
        self.router_s, self.serving = profile["router_s"], profile["serving"]
        self.sampling = None  # what sampling adds to a step (sample_at: run() sets it from the workload)
        self.sampling_profiled = eng.get("sampling")  # (profiles before it: none)
        # a decode step beside another engine's decoding, over alone (profiles before it, GPUs: none)
        on_host = deployment.spends <= profile.get("machine", {}).get("cores", 0) and not deployment.gpu
        self.contention = (eng.get("contention") or {}).get("decoding") if on_host else None
        prefill_serving = profile.get("prefill_serving")
        colocated_prefills = None  # what serving adds to a `pdserve colocated`'s prefills (older profiles: none)
        if deployment.single_process:  # (a profile without its decode-step figure: the nodes')
            self.serving = profile.get("colocated_serving", {}).get(key, self.serving)
            colocated_prefills = profile.get("colocated_prefill_serving", {}).get(key)
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()
        self._tokens = random.Random(7)
        self._timing = None if timing_seed is None else random.Random(timing_seed)
        self.decode_pool = EndpointPool("decode", [])
        self.prefill_pool = EndpointPool("prefill", [])
        local = deployment.colocated > 0
        self.placement = Placement(
            "always" if local else deployment.local_prefill,
            deployment.max_local_tokens,
            late_binding=deployment.late_binding,
            max_local_tpot_s=deployment.max_local_tpot,
        )
        beside = deployment.prefill_tokens_with_decodes  # a decode node's default, none in `pdserve colocated`
        if beside is not None and beside < 0:
            raise ValueError(f"prefill_tokens_with_decodes must be >= 0, got {beside}")
        if beside is None:
            beside = 0 if deployment.single_process else DECODE_NODE_PREFILL_TOKENS
        self.decodes = [
            Engine(self, f"decode-{i}", model, budget, capacity, served=colocated_prefills, prefill_with_decodes=beside)
            for i in range(deployment.colocated or deployment.decode)
        ]
        self.prefills = [
            Engine(self, f"prefill-{i}", model, budget, capacity, prefill_node=True, served=prefill_serving)
            for i in range(deployment.prefill)
        ]
        self.decode_pool.endpoints = [e.endpoint for e in self.decodes]
        self.prefill_pool.endpoints = [e.endpoint for e in self.prefills]
        self.engines = self.prefills + self.decodes
        self.engine_of = {e.endpoint.address: e for e in self.engines}
        self.held: list[Callable[[], None]] = []  # requests waiting for a place (Decision.hold)

    def sample_at(self, temperature: float) -> None:
        """Steps price what sampling adds at this temperature (at 0, greedy: nothing)."""
        if temperature < 0:
            raise ValueError(f"the temperature must be >= 0, got {temperature}")
        if temperature > 0 and self.sampling_profiled is None:
            raise ValueError("the profile has no sampling cost (written before it was measured): profile again")
        self.sampling = self.sampling_profiled if temperature > 0 else None

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn))

    def token(self) -> int:
        return self._tokens.randrange(1, 1 << 30)

    def late(self) -> float:
        """A draw of U(0, ARRIVAL_JITTER_S), 0 without a timing seed: how late a request reaches
        its engine, or an idle engine starts the step that work arriving asks of it."""
        return self._timing.uniform(0.0, ARRIVAL_JITTER_S) if self._timing is not None else 0.0

    def run(self, workload: Workload) -> Report:
        self.records: list[RequestRecord] = []  # each request's times, as `pdserve bench` keeps them
        self.sample_at(workload.temperature)
        records = self.records
        items = iter(workload.items)

        def start_item(item: Item, done: Callable[[], None]) -> None:
            history: list[int] = []

            def turn(k: int) -> None:
                nonlocal history
                prompt = history + item.turns[k]
                rec = RequestRecord(sent=self.now, prompt_tokens=len(prompt))
                records.append(rec)

                def finished(answer: list[int]) -> None:
                    nonlocal history
                    history = prompt + answer
                    turn(k + 1) if k + 1 < len(item.turns) else done()

                self.request(prompt, item.output_len, rec, finished)

            turn(0)

        if workload.times is not None:  # a trace: each item at its time
            for t, item in zip(workload.times, workload.items, strict=True):
                self.at(t, lambda item=item: start_item(item, lambda: None))
        elif workload.rate is None:  # closed loop: each worker sends its next item after the last one

            def worker() -> None:
                item = next(items, None)
                if item is not None:
                    start_item(item, worker)

            for _ in range(workload.concurrency or 1):
                worker()
        else:
            times = arrival_times(len(workload.items), workload.rate, "poisson", random.Random(workload.seed))
            for t, item in zip(times, workload.items):
                self.at(t, lambda item=item: start_item(item, lambda: None))
        while self._events:
            self.now, _, fn = heapq.heappop(self._events)
            fn()
        assert not self.held, f"{len(self.held)} requests held with no prefill left to end"
        duration = max(r.done for r in records) if records else 0.0
        rep = report(records, duration, *self.slo)
        engines = self.engines
        rep.extra = {
            "deployment": self.deployment.describe(),
            ("gpus" if self.deployment.gpu else "cores"): self.deployment.spends,
            "utilization": {e.endpoint.address: round(e.busy_s / duration, 3) for e in engines} if duration else {},
        }
        return rep

    # ---- one request: the router's steps ----------------------------------------------------------
    def request(self, prompt: list[int], output_len: int, rec: RequestRecord, finished: Callable) -> None:
        """Placed by the router's code after its own share of the time; then prefilled (locally
        or on a prefill node, the KV handed off) and decoded; rec gets its times. The endpoints
        count what is in flight with the router's own context managers, entered and left where
        the router enters and leaves them (a remote request counts on its decode node from its
        first token on)."""
        decoding = contextlib.ExitStack()  # decode.track(), until the last token

        def on_token(now: float, last: bool) -> None:
            rec.num_tokens += 1
            rec.first_token = now if rec.first_token is None else rec.first_token
            if last:
                rec.done = now
                decoding.close()
                finished(seq.tokens[len(prompt) :])

        seq = Decoding(list(prompt), output_len, on_token)
        decode = self.decode_pool.pick(prompt=prompt)
        self._place(Request(prompt, rec, seq, block_hashes(prompt[:-1], self.block_size), decode, decoding))

    def _place(self, r: Request) -> None:
        """The router's _place: a request it holds is placed again when a prefill ends."""
        prefill = self.prefill_pool.pick(prompt=r.prompt) if self.prefill_pool.endpoints else None
        decode_cached = self.decode_pool.cached_tokens(r.decode, r.prompt)
        moved = len(r.prompt) - (decode_cached if self.partial else 0)
        plan = self.placement.decide(
            len(r.prompt),
            decode_cached,
            self.prefill_pool.cached_tokens(prefill, r.prompt) if prefill else 0,
            moved=moved,
            prefill_queued=prefill.prefill_tokens if prefill else 0,
            local_queued=r.decode.prefill_tokens,
            decode_running=r.decode.outstanding,
            prefill_node=prefill is not None,
            decode_tpot_s=r.decode.token_gaps.tpot_s,
        )
        if plan.hold:
            self.held.append(lambda: self._place(r))
        elif plan.local or prefill is None:
            self._prefill_locally(r, plan.local_tokens)
        else:
            self._prefill_remotely(r, prefill, plan.remote_tokens, moved)

    def _prefill_locally(self, r: Request, tokens: int) -> None:
        began = self.now + self.router_s + self.late()
        engine = self.engine_of[r.decode.address]
        r.decoding.enter_context(r.decode.track())
        prefilling = contextlib.ExitStack()
        alone = prefilling.enter_context(r.decode.prefill(tokens))

        def done(now: float, cached: int) -> None:
            prefilling.close()
            self.at(now, self._prefill_ended)
            r.rec.cached_tokens, r.rec.local_prefill = cached, True
            self.placement.measured_local(len(r.prompt) - cached, now - began, alone)
            r.seq.streamed_at = now  # the decode node's first message
            if self._first_token(r, now):
                engine.add_decoding(r.seq)

        r.seq.names = r.names  # its prompt's blocks, a cached prefix's shared
        self.at(began, lambda: engine.add_prefill(Prefill(r.prompt, r.names, done)))

    def _prefill_remotely(self, r: Request, prefill: Endpoint, tokens: int, moved: int) -> None:
        began = self.now + self.router_s + self.late()
        # a hand-off that can leave out the blocks the decode node holds shares them (and names the
        # ones it imports); one that moves the whole KV writes fresh blocks: nothing shared
        r.seq.names = r.names if self.partial else []
        prefilling = contextlib.ExitStack()
        prefilling.enter_context(prefill.track())
        alone = prefilling.enter_context(prefill.prefill(tokens))

        def done(now: float, cached: int) -> None:
            prefilling.close()
            self.at(now, self._prefill_ended)
            r.rec.cached_tokens = cached
            r.decoding.enter_context(r.decode.track())
            if not self._first_token(r, now):
                return
            handoff = self.handoff["fixed_s"] + self.handoff["per_token_s"] * moved
            self.placement.measured_remote(len(r.prompt) - cached, now - began, handoff, moved, self.router_s, alone)
            self.at(now + handoff, lambda: self.engine_of[r.decode.address].add_decoding(r.seq))

        self.at(began, lambda: self.engine_of[prefill.address].add_prefill(Prefill(r.prompt, r.names, done)))

    def _first_token(self, r: Request, now: float) -> bool:
        """The prefill's sampled token; whether the request decodes on."""
        r.seq.tokens.append(self.token())
        r.seq.left -= 1
        r.seq.on_token(now, r.seq.left <= 0)
        return r.seq.left > 0

    def _prefill_ended(self) -> None:
        held, self.held = self.held, []
        for place in held:
            place()


def simulate(
    profile: dict,
    deployment: Deployment,
    workload: Workload,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    timing_seed: int | None = None,
) -> Report:
    return Simulation(profile, deployment, slo_ttft, slo_tpot, timing_seed).run(workload)


SPREAD = {  # what timing_spread summarizes: a name, and the figure of a report
    "goodput_tps": lambda r: r.goodput_tps,
    "ttft_p50_s": lambda r: r.ttft_s["p50"],
    "ttft_p95_s": lambda r: r.ttft_s["p95"],
    "tpot_p50_s": lambda r: r.tpot_s["p50"],
    "tpot_p95_s": lambda r: r.tpot_s["p95"],
}


def timing_spread(reports: list[Report]) -> dict:
    """{figure: {"median", "min", "max"}} over the runs of several timing seeds."""
    out = {}
    for name, figure in SPREAD.items():
        values = [figure(r) for r in reports]
        out[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out
