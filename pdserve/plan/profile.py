"""`pdserve plan profile`: what this hardware and model cost, measured, for the simulator.

    pdserve plan profile --model smollm2-135m --dtype float32 --threads 1,2 --out profile.json

For each thread count (a node's share of the cores), an engine of this model times its own steps:
prefills alone over (new tokens, tokens already cached), decode steps over (batch, context) (the
sequences sharing their leading blocks, and a few sharing none), and decode steps with a prefill
chunk mixed in (a local prefill); the step line (step_model.py) is fitted to them. It times the
sampler at temperature 1 beside greedy, and (on a CPU with cores for two such engines) a decode step
beside a second engine decoding on the other cores, over the same step alone. Then a real
prefill node and decode node (their own processes, one torch thread and one core each, as `pdserve
up --pin-cpus` runs them) and a router on this host's loopback hand KV over each transport
(layer-wise where it can): the time from the prefill's end to the decode node's admission is fitted
as a line over the KV's tokens, and the router's own share of TTFT and what serving adds to a
decode step are measured (from the decode node's own step log, over steps of the same shape timed
unserved in this process just before: on a CPU), and what it takes from the
prefill node's prefills: a lone prompt's and a follow-up's (a few new tokens after a cached
prefix), and the prompt's while streams decode beside them. What serving adds is measured again
for `pdserve colocated` at each thread count, where the serving threads take time from the cores
the engine computes on: to its decode steps, and to a lone prompt's and a follow-up's prefill. On
CUDA the same command writes a GPU's profile (--device).

Sizes are the device's grid (--quick: a smaller one, for tests); each figure is the median of
--repeat runs. A GPU's grid reaches the engine's own caps (a step of max_num_batched_tokens, a
decode batch of max_num_seqs): a small model's steps on a GPU stay bound by the host's kernel
launches until near those sizes, and the line is then fitted over every step size the engine
runs (the simulator keeps a step within the token budget; it does not cap its batch at
max_num_seqs). --kv-cache-gb sizes the profiled engine's KV cache, which the simulator takes as
each engine's capacity. The file records the machine, model, dtype and the raw samples beside
the fits.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.plan.profile_file import VERSION
from pdserve.plan.step_model import Step, StepModel, shared_tokens

PREFILL_GRID = [(n, 0) for n in (16, 64, 256, 640, 1280, 2560)] + [(n, 1024) for n in (16, 64, 256, 640)]
# (4, 1024) and (16, 1024): sequences sharing a long prefix, as a chat's turns share its system prompt
# (a GPU's grid, built on this one, has them too)
# (without them the line priced served chat steps of 4 sequences of ~1,150 tokens, ~1,000 shared, at
# 43-44 ms where they took 35-44 ms: 1 thread, AVX512_BF16, docs/bench/plan_accuracy_paired_r*.json)
DECODE_GRID = [(1, 64), (1, 1024), (4, 64), (4, 640), (4, 1024), (16, 64), (16, 640), (16, 1024), (64, 64), (64, 640)]
# decode steps whose sequences share no block (as requests without a common prefix decode): the
# grid above shares their leading blocks, which a step reads from cache; at long contexts and small
# batches the line fitted without these priced a step under what served ones took (1 thread,
# AVX512_BF16: 2 sequences of ~1,150 tokens, 34 ms on the line, 41-42 ms in colocated-x2's served steps)
DISTINCT_GRID = [(2, 1024), (4, 1024), (8, 640)]
MIXED_GRID = [(4, 640, 64), (4, 640, 640), (16, 640, 256)]  # (batch, context, prefill chunk)
TOKENS, SEQS = EngineConfig.max_num_batched_tokens, EngineConfig.max_num_seqs  # the engine's caps: a GPU's grid
GRIDS = {  # (new, cached) prefills, (batch, context) decode steps (shared, distinct), (batch, context, chunk) mixed
    "cpu": {"prefill": PREFILL_GRID, "decode": DECODE_GRID, "distinct": DISTINCT_GRID, "mixed": MIXED_GRID},
    "cuda": {
        "prefill": PREFILL_GRID + [(TOKENS, 0), (TOKENS // 2, TOKENS // 2)],
        "decode": DECODE_GRID + [(64, 2048), (SEQS // 2, 640), (SEQS, 640), (SEQS, 2048)],
        "distinct": DISTINCT_GRID,
        # a mixed step leaves its prompt a sequence's slot (at SEQS running it would wait: a decode step)
        "mixed": MIXED_GRID + [(64, 640, 1024), (SEQS - 1, 640, TOKENS // 2)],
    },
}
HANDOFF_TOKENS = (128, 512, 1024)
NO_OVERHEAD = {"fixed_s": 0.0, "per_sequence_s": 0.0, "samples": []}  # (no one-thread step line to subtract)
# (no one-thread step line to compare with)
NO_SHARE = {"fixed_s": 0.0, "fixed": 0.0, "per_sequence": 0.0, "samples": []}
STREAMS = (1, 4, 8, 16)  # streams decoding together through the router
STREAM_PROMPT = 600  # the streams' prompts: a served step at the anchor's context, where part of
# what serving adds overlaps the step's compute (at 16 tokens the step is too short to show it)
assert STREAM_PROMPT > 16
HANDOFF_BLOCKS = 1024  # the engines hold 16 streams of STREAM_PROMPT + 48 tokens (a small KV tensor starts fast)
QUICK = {
    "prefill": [(16, 0), (64, 0), (16, 64)],
    "decode": [(1, 16), (4, 16)],
    "distinct": [(2, 16)],
    "mixed": [(2, 16, 16)],
    "handoff": (16, 48),
    "streams": (1, 2),
    "stream_prompt": 16,
    "follow_up": (16, 16),
    "sampled_rows": (1, 4),
    "contention": {"rounds": 1, "context": 16},
}
DECODE_STEPS = 6  # timed per decode sample (median)
# the decode grid is timed in two passes, the second reversed, DECODE_STEPS // 2 steps a shape each
# time, a shape sharing its blocks beside the same shape sharing none: timed one grid after the other,
# the machine's drift between them passed for the price of sharing (docs/benchmarks.md at 0f5299a, "The decode
# grid in two passes")
DECODE_PASSES = 2
MIN_BATCH_SHARE = 0.05  # batch sizes of fewer served decode steps than this share stay out of serving's fit
BUSY_GAP_S = 0.05  # a served engine's next step within this is serving's time between steps; later, a wait for work
STREAM_LONG = 256  # tokens a stream may decode while a prefill beside it is timed (it is stopped then)
FOLLOW_UP = (64, 1024)  # a served prefill of this many new tokens after this many cached (a chat's next turn)
# served requests decode greedily, as the grid's steps and `pdserve bench` (its default) do; the
# protocol's default, temperature 1, samples each row over the vocabulary: at 8 streams of the
# default model that took 9-10 ms of a 64 ms fp32 step (AVX2, one thread), which the profile
# priced as serving (docs/benchmarks.md at 0f5299a, "Served decode steps sampled")
SERVED = {"temperature": 0.0, "ignore_eos": True}
SAMPLED_ROWS = (1, 8, 32)  # logit rows the engine's sampler draws from at temperature 1, timed beside greedy
# A decode step beside a second engine decoding on the host's other cores (colocated-x2's two
# engines) reads its weights while the other reads its own: one sequence of 1,190 tokens took
# 1.08-1.24x as long (median 1.19x; 600 tokens: 1.17x; fp32, AVX2, served: docs/benchmarks.md at 0f5299a,
# "Decode steps beside a second engine"). Timed alone and beside, rounds alternating.
CONTENTION = {"rounds": 5, "context": 600}


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _timed(llm: LLMEngine) -> float:
    t = time.perf_counter()
    llm.step()
    return time.perf_counter() - t


def _run_out(llm: LLMEngine, abort: bool = True) -> None:
    """Ends every request (aborted, or run to its end), its blocks freed or cached."""
    if abort:
        for rid in [seq.request_id for seq in llm.scheduler.running + list(llm.scheduler.waiting)]:
            llm.abort_request(rid)
    while llm.has_unfinished():
        llm.step()


class StepProfiler:
    """Times single engine steps of known contents (each request's ids random: no cache hit but
    the ones set up)."""

    def __init__(self, config: EngineConfig, repeat: int, seed: int = 0):
        self.llm = LLMEngine(config)
        self.vocab = self.llm.model_config.vocab_size
        self.repeat = repeat
        self.rng = random.Random(seed)
        self.samples: list[tuple[Step, float]] = []
        self._add_prefilled([16] * 2, 8)  # warm-up: the first prefill and decode steps pay one-time costs
        _run_out(self.llm, abort=False)

    def _params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, **SERVED)

    def _add_prefilled(self, contexts: list[int], max_tokens: int, shared: bool = True) -> None:
        """Sequences decoding with these contexts (shared: their leading blocks in common, so that
        setting up a large batch costs one prefill of the context, not one per sequence)."""
        prefix = _ids(self.rng, max(0, min(contexts) - 16), self.vocab) if shared else []
        for n in contexts:
            self.llm.add_request(
                uuid.uuid4().hex, prefix + _ids(self.rng, n - len(prefix), self.vocab), self._params(max_tokens)
            )
        while (
            any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in self.llm.scheduler.running)
            or self.llm.scheduler.waiting
        ):
            self.llm.step()

    def prefill(self, new: int, cached: int) -> float:
        times = []
        for _ in range(self.repeat):
            prefix = _ids(self.rng, cached, self.vocab)
            if cached:
                self.llm.add_request(uuid.uuid4().hex, prefix + [11], self._params(1))
                _run_out(self.llm, abort=False)
            self.llm.add_request(uuid.uuid4().hex, prefix + _ids(self.rng, new, self.vocab), self._params(1))
            times.append(_timed(self.llm))
            _run_out(self.llm)
        t = statistics.median(times)
        self.samples.append((Step([(new, cached)], []), t))
        return t

    def reference(self, batch: int, context: int) -> list[list]:
        """DECODE_STEPS decode steps of `batch` sequences of `context` tokens sharing their leading
        blocks, as _decode_steps lists served ones: [sequences, seconds, contexts, shared]."""
        self.decode(batch, context)
        return [[len(s.decodes), t, s.decodes, s.shared] for s, t in self.samples[-DECODE_STEPS:]]

    def decode(self, batch: int, context: int, chunk: int = 0, shared: bool = True, steps: int = DECODE_STEPS) -> float:
        """A decode step of `batch` sequences (with a `chunk`-token prefill mixed in; shared: their
        leading blocks in common), timed `steps` times (with a prefill: `repeat` times)."""
        self._add_prefilled([context] * batch, steps + self.repeat + 4, shared)
        times = []
        for _ in range(self.repeat if chunk else steps):
            contexts = [seq.num_tokens for seq in self.llm.scheduler.running]
            held = shared_tokens([seq.block_table for seq in self.llm.scheduler.running], self.llm.config.block_size)
            if chunk:  # a local prefill joins this step
                self.llm.add_request(uuid.uuid4().hex, _ids(self.rng, chunk, self.vocab), self._params(1))
            times.append(_timed(self.llm))
            if self.llm.scheduler.waiting:  # (its slot or its tokens over the engine's caps)
                raise RuntimeError(f"a {chunk}-token prompt beside {batch} sequences was not in the step timed")
            self.samples.append((Step([(chunk, 0)] if chunk else [], contexts, held), times[-1]))
        _run_out(self.llm)
        return statistics.median(times)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def grid(device: str, quick: bool) -> dict:
    from engine.hardware import resolve_device

    return QUICK if quick else GRIDS[resolve_device(device).type]


def profile_steps(config: EngineConfig, repeat: int, quick: bool) -> dict:
    threads, sizes = config.num_threads, grid(config.device, quick)
    torch.set_num_threads(threads)
    prof = StepProfiler(config, repeat)
    for new, cached in sizes["prefill"]:
        _say(
            f"{threads} thread(s): prefill of {new} new tokens after {cached} cached: {prof.prefill(new, cached):.4f} s"
        )
    shapes = sorted([(b, c, 0, True) for b, c in sizes["decode"]] + [(b, c, 0, False) for b, c in sizes["distinct"]])
    shapes += [(b, c, chunk, True) for b, c, chunk in sizes["mixed"]]
    for n in range(DECODE_PASSES):
        for batch, context, chunk, shared in shapes if n % 2 == 0 else shapes[::-1]:
            t = prof.decode(batch, context, chunk, shared, steps=DECODE_STEPS // DECODE_PASSES)
            what = f", {chunk}-token prefill mixed in" if chunk else "" if shared else ", no block shared"
            _say(f"{threads} thread(s), pass {n + 1}: decode step, {batch} x {context} tokens{what}: {t:.4f} s")
    fit = StepModel.fit(prof.samples)
    errors = [abs(fit.seconds(s) - t) / t for s, t in prof.samples]
    sampling = sampling_cost(prof.llm, QUICK["sampled_rows"] if quick else SAMPLED_ROWS, repeat)
    _say(f"{threads} thread(s): sampling at temperature 1: {sampling['per_row_s'] * 1e3:.2f} ms a row over greedy")
    contention = decode_contention(prof, config, **(QUICK["contention"] if quick else CONTENTION))
    if contention:
        _say(f"{threads} thread(s): a decode step beside another engine decoding: {contention['decoding']:.2f}x")
    return {
        "threads": threads,
        "dtype": str(prof.llm.dtype).removeprefix("torch."),
        "block_size": config.block_size,
        "num_kv_blocks": prof.llm.kv_cache.num_blocks,
        "decode_kernel": prof.llm.runner.decode_kernel,  # decodes read the KV in place (else SDPA over gathered KV)
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "step": fit.to_dict(),
        "sampling": sampling,
        "contention": contention,
        "fit_error_median": statistics.median(errors),
        "fit_error_max": max(errors),
        "samples": [
            {"prefills": s.prefills, "decodes": s.decodes, "shared": s.shared, "seconds": t} for s, t in prof.samples
        ],
    }


def sampling_cost(llm: LLMEngine, rows: tuple[int, ...], repeat: int) -> dict:
    """What sampling at temperature 1 (top-k and top-p off, the protocol's defaults) adds to a step
    over greedy decoding, which the step line and the served steps are timed at (SERVED): the
    engine's own sampler over logits of the model's vocabulary, each size `repeat` times with the
    two alternating; fixed_s + per_row_s x rows through the sizes' medians, the samples beside."""
    sampler, vocab, device = llm.runner.sampler, llm.model_config.vocab_size, llm.device
    greedy, sampled = SamplingParams(**SERVED), SamplingParams(**SERVED | {"temperature": 1.0})

    def timed(logits: torch.Tensor, params: SamplingParams) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        sampler(logits, [params] * len(logits), [0] * len(logits))  # (its token ids come back to the host)
        return time.perf_counter() - t

    samples = []
    for n in rows:
        logits = torch.randn(n, vocab, device=device, dtype=torch.float32)
        timed(logits, sampled)  # (first use of a size)
        for _ in range(repeat):
            samples.append((n, timed(logits, sampled) - timed(logits, greedy)))
    line = _line(samples)
    return {"fixed_s": line["fixed_s"], "per_row_s": line["per_token_s"], "samples": samples}


def decode_contention(prof: StepProfiler, config: EngineConfig, rounds: int, context: int) -> dict | None:
    """A decode step of one sequence beside a second engine of this model decoding on as many of
    the host's other cores, over the same step alone: each round times it with the other engine
    stopped (SIGSTOP), then running; the median of the rounds' ratios, the pairs of medians beside.
    None on a GPU, where the cores hold no second engine, or where processes cannot be placed on
    cores (macOS). Its steps stay out of the step line."""
    from engine.hardware import resolve_device
    from serving.process import usable_cores

    cores, threads = usable_cores(), config.num_threads
    if resolve_device(config.device).type != "cpu" or len(cores) < 2 * threads or not hasattr(os, "sched_setaffinity"):
        return None
    code = "import sys; from pdserve.plan.profile import decode_forever as f; f(*sys.argv[1:])"
    args = [config.model, config.dtype, str(threads), str(context)]
    other = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    keep = len(prof.samples)
    try:
        os.sched_setaffinity(other.pid, cores[threads : 2 * threads])
        os.sched_setaffinity(0, cores[:threads])
        if other.stdout.readline().strip() != b"decoding":
            raise RuntimeError(f"the second engine did not start (exit {other.wait()})")
        samples = []
        for _ in range(rounds):
            other.send_signal(signal.SIGSTOP)
            alone = prof.decode(1, context)
            other.send_signal(signal.SIGCONT)
            samples.append([alone, prof.decode(1, context)])
    finally:
        other.kill()
        other.wait()
        os.sched_setaffinity(0, cores)
        del prof.samples[keep:]
    return {"decoding": statistics.median(b / a for a, b in samples), "context": context, "samples": samples}


def decode_forever(model: str, dtype: str, threads: str, context: str) -> None:
    """The second engine of decode_contention (its own process): one sequence of `context`
    tokens decoding, step after step, until killed."""
    torch.set_num_threads(int(threads))
    config = EngineConfig(
        model=model, dtype=dtype, device="cpu", num_threads=int(threads), num_kv_blocks=HANDOFF_BLOCKS
    )
    prof = StepProfiler(config, 1)
    while True:
        prof._add_prefilled([int(context)], prof.llm.max_model_len - int(context))
        print("decoding", flush=True)  # (its prompt's prefill done: minutes of decode steps follow)
        _run_out(prof.llm, abort=False)


async def profile_serving(model: str, dtype: str, device: str, threads: list[int], repeat: int, quick: bool) -> dict:
    """Laid out as `pdserve up --prefill 1 --decode 1 --pin-cpus` runs them (_node_processes),
    the router in this process. Per transport (and layer-wise where it streams): seconds from the
    prefill's end to the decode node's admission over the KV's tokens; the router's share of TTFT;
    and, through the first transport, the decode steps of B streams decoding together as the
    decode node logged them (what serving adds to a step is their time less the step line's),
    the prefill node's prefills beside them, and a follow-up's prefill. Then the same streams, a
    lone prompt's and a follow-up's prefill from `pdserve colocated` at each thread count: one
    process whose serving threads share the cores its engine's compute threads use."""
    steps = Path(tempfile.mkdtemp(prefix="pdserve-steps-"))  # the engines' step logs (owner-only)
    try:
        return await _profile_serving(model, dtype, device, threads, repeat, quick, steps)
    finally:
        shutil.rmtree(steps, ignore_errors=True)


async def _profile_serving(
    model: str, dtype: str, device: str, threads: list[int], repeat: int, quick: bool, steps: Path
) -> dict:
    from kvtransfer import transports
    from router.client import AsyncClient
    from router.config import RouterConfig
    from router.server import Router
    from serving.process import usable_cores

    rng, vocab = random.Random(1), _vocab(model)
    stream_prompt = QUICK["stream_prompt"] if quick else STREAM_PROMPT
    follow_up = QUICK["follow_up"] if quick else FOLLOW_UP
    out, router_s, streams, prefills, follow_ups = {}, [], [], [], []
    reference = _reference(model, dtype, device, 1)
    async with _node_processes(model, dtype, device, list(transports.TRANSPORTS), steps) as nodes:
        prefill = nodes.pop("prefill")
        for name, decode in nodes.items():
            for layerwise in ("off", "auto"):  # auto: layer-wise where the transport streams
                config = RouterConfig(port=0, local_prefill="off", kv_layerwise=layerwise)
                router = Router(model, [prefill.address], [decode.address], config)
                await router.start()
                try:
                    ends = (router.prefill_pool.endpoints[0], router.decode_pool.endpoints[0])
                    if Router.kv_read(*ends) is None:  # shm with the KV on a GPU: no region offered
                        _say(f"no hand-off over {name} here: the prefill node does not offer it")
                        break
                    if layerwise == "auto" and not router.layerwise(*ends):
                        break  # the same hand-off as "off"
                    samples = []
                    async with AsyncClient(router.address) as client:
                        for n in QUICK["handoff"] if quick else HANDOFF_TOKENS:
                            for _ in range(repeat):
                                t = (await _streams(client, [_ids(rng, n, vocab)], 2))[0][1]
                                samples.append((n, t.decode_admitted - t.prefill_end))
                                router_s.append(t.first_token - t.queued - (t.prefill_end - t.prefill_start))
                                used = t.kv_transport
                        if not streams:
                            log = steps / f"{name}.jsonl"
                            streams = await _served_steps(
                                client, log, rng, vocab, stream_prompt, repeat, quick, reference
                            )
                            prefills = await _served_prefills(client, rng, vocab, stream_prompt, repeat, quick)
                            follow_ups = await _served_follow_ups(client, rng, vocab, follow_up, repeat)
                finally:
                    await router.stop(0)
                line = out[used] = _line(samples) | {"samples": samples}
                _say(f"hand-off over {used}: {line['fixed_s'] * 1e3:.1f} ms + {line['per_token_s'] * 1e6:.2f} us/token")
    if not out:
        raise RuntimeError("pdserve plan profile: no KV transport worked between the two nodes")
    colocated, colocated_prefills, cores = {}, {}, usable_cores()
    for t in threads:  # on the first t cores, as `pdserve plan best` runs it (search.command)
        reference = None  # (the last one's memory back before the next loads)
        reference = _reference(model, dtype, device, t)
        log = steps / f"colocated-{t}.jsonl"
        args = ["-m", "pdserve", "colocated", *_engine_args(model, dtype, device, t, log)]
        args += ["--cpus", ",".join(map(str, cores[:t]))]
        async with _processes({"colocated": args}) as servers:
            async with AsyncClient(servers["colocated"].address) as client:
                colocated[str(t)] = await _served_steps(
                    client, log, rng, vocab, stream_prompt, repeat, quick, reference, f"colocated x {t}"
                )
                lone = await _served_prefills(client, rng, vocab, stream_prompt, repeat, quick, streams=())
                colocated_prefills[str(t)] = (lone, await _served_follow_ups(client, rng, vocab, follow_up, repeat))
    return {
        "handoff": out,
        "router_s": statistics.median(router_s),
        "streams": streams,
        "prefills": prefills,
        "follow_ups": follow_ups,
        "follow_up": follow_up,
        "colocated_prefills": colocated_prefills,
        "colocated_streams": colocated,
        "stream_prompt": stream_prompt,
    }


def _reference(model: str, dtype: str, device: str, threads: int) -> StepProfiler | None:
    """An engine of `threads` torch threads in this process, to time decode steps of the streams'
    shape just before each served run of them (_served_steps); none on a GPU, whose memory the
    nodes' KV caches take."""
    from engine.hardware import resolve_device

    if resolve_device(device).type != "cpu":
        return None
    config = EngineConfig(model=model, dtype=dtype, device=device, num_threads=threads, num_kv_blocks=HANDOFF_BLOCKS)
    return StepProfiler(config, repeat=1)


def _engine_args(model: str, dtype: str, device: str, threads: int, step_log: Path | None = None) -> list[str]:
    args = ["--model", model, "--dtype", dtype, "--device", device, "--num-threads", str(threads)]
    args += ["--step-log", str(step_log)] if step_log else []
    return args + ["--port", "0", "--num-kv-blocks", str(HANDOFF_BLOCKS)]


def _node_processes(model: str, dtype: str, device: str, transports: list[str], steps: Path):
    """A prefill node process on the first core this process may use and a decode node process
    per transport on the last, one torch thread each; each decode node logs its steps to
    steps/NAME.jsonl."""
    from serving.process import usable_cores

    cores, common = usable_cores(), _engine_args(model, dtype, device, 1)
    specs = {"prefill": ["-m", "prefill_node", *common, "--cpus", str(cores[0])]}
    for name in transports:
        logged = _engine_args(model, dtype, device, 1, steps / f"{name}.jsonl")
        specs[name] = ["-m", "decode_node", *logged, "--cpus", str(cores[-1]), "--kv-transport", name]
    return _processes(specs)


@contextlib.asynccontextmanager
async def _processes(specs: dict[str, list[str]]):
    """{name: server process} started from {name: python's arguments}, ready, and stopped by PID
    at the end. Their logs go to an owner-only temporary directory, kept (and named) when
    something failed."""
    from pdserve.up import READY_TIMEOUT_S
    from serving.launcher import ServerProcess
    from serving.process import PARENT_ENV

    logs = Path(tempfile.mkdtemp(prefix="pdserve-profile-"))
    started, ok = {}, False
    try:
        for name, args in specs.items():
            log = os.open(logs / f"{name}.log", os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(log, "w") as stderr:  # the child keeps its own descriptor
                started[name] = ServerProcess(args, stderr=stderr, env={PARENT_ENV: str(os.getpid())})
        await asyncio.wait_for(asyncio.gather(*(p.ready() for p in started.values())), READY_TIMEOUT_S)
        yield dict(started)  # the caller may take some out; all of them stop
        ok = True
    finally:
        await asyncio.gather(*(p.stopped(10) for p in started.values()))
        if ok:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            _say(f"pdserve plan profile: the processes' logs are in {logs}")


def _vocab(model: str) -> int:
    from engine.model_config import ModelConfig
    from engine.model_source import resolve_model

    return ModelConfig.from_dir(resolve_model(model)).vocab_size


async def _served_steps(
    client,
    log: Path,
    rng: random.Random,
    vocab: int,
    prompt: int,
    repeat: int,
    quick: bool,
    reference: StepProfiler | None,
    through: str = "the router",
) -> dict:
    """B streams decoding together, `repeat` times each: "steps", the decode steps their engine
    ran, as [decoding sequences, seconds to the next step's start (the step and the serving
    between two steps), their contexts, the KV tokens they share] from the engine's step log
    (--step-log), which serving_overhead prices against the step line; and "tpots", (B, the
    streams' median TPOT) per run, as the client saw it (kept beside: a TPOT less the line, how
    this was priced before, also counts the streams' own prefills). Their prompts share all but 16 tokens, cached
    (on the prefill node, or the colocated engine) by a first request, so that they start decoding
    together rather than a prefill apart. "reference": before each run, the same engine's steps
    of as many sequences of that context, timed unserved by `reference` in this process (a window
    apart of seconds, not the minutes since the step line's samples; none without one)."""
    shared = await _cached_prefix(client, rng, vocab, prompt - 16, 2)
    steps, tpots, unserved = [], [], []
    for batch in QUICK["streams"] if quick else STREAMS:
        for _ in range(repeat):
            if reference is not None:
                unserved += reference.reference(batch, prompt + 24)
            start = log.stat().st_size
            done = await _streams(client, [shared + _ids(rng, 16, vocab) for _ in range(batch)], 48)
            tpots.append((batch, statistics.median(tpot for tpot, _ in done)))
            steps += _decode_steps(log, start)
        tpot = statistics.median(t for b, t in tpots if b == batch)
        _say(f"{batch} stream(s) of {prompt} prompt tokens through {through}: TPOT {tpot * 1e3:.1f} ms")
    return {"steps": steps, "tpots": tpots, "reference": unserved}


def _decode_steps(log: Path, start: int) -> list[list]:
    """The decode-only steps logged after byte `start`, each until the next step's start (where
    that comes within BUSY_GAP_S: a longer gap is the engine waiting for work)."""
    with open(log, "rb") as f:
        f.seek(start)
        lines = [json.loads(line) for line in f.read().decode().splitlines()]
    found = []
    for s, after in zip(lines, lines[1:] + [None]):
        if s["prefills"] or not s["decodes"]:
            continue
        gap = after["t"] - s["t"] - s["s"] if after else 0.0
        seconds = s["s"] + (gap if 0.0 <= gap < BUSY_GAP_S else 0.0)
        found.append([len(s["decodes"]), seconds, s["decodes"], s["shared"]])
    return found


async def _served_prefills(
    client, rng: random.Random, vocab: int, prompt: int, repeat: int, quick: bool, streams: tuple | None = None
) -> list[tuple[int, float]]:
    """(B, seconds) of a new prompt's prefill on the prefill node while B streams decode through
    the router (B = 0: alone), from the node's own timings: what the router's relay and the
    client, unpinned, take from the prefill node's core. The streams run until the prefill ends.
    streams: the B > 0 to measure (default STREAMS; none for `pdserve colocated`, whose
    timings count from the request's arrival)."""
    shared = await _cached_prefix(client, rng, vocab, prompt - 16, 2)
    samples = []
    if streams is None:
        streams = QUICK["streams"] if quick else STREAMS
    for batch in (0, *streams):
        for _ in range(repeat):
            decoding = 0

            async def stream(ids):
                nonlocal decoding
                tokens = 0
                async for _ in client.stream(ids, max_tokens=STREAM_LONG, **SERVED):
                    tokens += 1
                    if tokens == 2:  # its decode node streams it
                        decoding += 1
                raise RuntimeError(f"a stream of {STREAM_LONG} tokens ended before the prefill it had to outlast")

            running = [asyncio.ensure_future(stream(shared + _ids(rng, 16, vocab))) for _ in range(batch)]
            try:
                while decoding < batch:
                    await asyncio.wait(running, timeout=0.01)
                    for task in running:
                        if task.done():
                            task.result()  # (raises what ended it)
                t = (await _streams(client, [_ids(rng, prompt, vocab)], 1))[0][1]
                for task in running:
                    if task.done():
                        task.result()
            finally:
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
            samples.append((batch, t.prefill_end - t.prefill_start))
        median = statistics.median(s for b, s in samples if b == batch)
        _say(f"a {prompt}-token prefill beside {batch} stream(s): {median:.3f} s")
    return samples


async def _served_follow_ups(
    client, rng: random.Random, vocab: int, follow_up: tuple[int, int], repeat: int
) -> list[float]:
    """Seconds of served prefills of `new` tokens after a cached prefix of `cached` (a first
    request caches it), alone, from the server's timings."""
    new, cached = follow_up
    prefix = await _cached_prefix(client, rng, vocab, cached, 1)
    samples = []
    for _ in range(repeat):
        t = (await _streams(client, [prefix + _ids(rng, new, vocab)], 1))[0][1]
        if t.cached_tokens != cached:  # (not the prefill it is meant to time)
            raise RuntimeError(f"a follow-up after {cached} cached tokens found {t.cached_tokens} in the cache")
        samples.append(t.prefill_end - t.prefill_start)
    _say(f"a served {new}-token prefill after {cached} cached: {statistics.median(samples):.3f} s")
    return samples


async def _cached_prefix(client, rng: random.Random, vocab: int, n: int, max_tokens: int) -> list[int]:
    """n random ids, cached by the server: sent once with 16 more and max_tokens to generate."""
    prefix = _ids(rng, n, vocab)
    await _streams(client, [prefix + _ids(rng, 16, vocab)], max_tokens)
    return prefix


async def _streams(client, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, object]]:
    """Sends the prompts at once; each one's (TPOT, timings) as the client saw it."""

    async def one(prompt):
        first = last = timings = None
        async for part in client.stream(prompt, max_tokens=max_tokens, **SERVED):
            last = time.perf_counter()
            first = first or last
            timings = part.timings if part.finished else timings
        return (last - first) / max(1, max_tokens - 1), timings

    return await asyncio.gather(*(one(p) for p in prompts))


def serving_overhead(served: dict, step: StepModel) -> dict:
    """What serving adds to each decode step (streaming, the router's relay, the processes'
    event loops and, in one colocated process, its serving threads' share of the engine's
    cores), as fixed + per sequence: each served decode step's seconds (to the next one's start,
    _served_steps) less the step line's for what it computed, less what the unserved reference
    steps took over the line (less_drift). Beside the fit: "line_samples", the served steps over
    the line alone (how this was priced before the reference), the reference steps, and the
    streams' TPOTs."""
    over, reference = _over_line(served["steps"], step), served.get("reference", [])
    fit = serving_fit(less_drift(over, _over_line(reference, step)))
    return fit | {"line_samples": over, "reference": reference, "tpot_samples": served["tpots"]}


def less_drift(over: list[tuple[int, float]], reference: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Served steps' (sequences, seconds over the line), each less the median over the line of the
    unserved reference steps of the nearest batch size (the machine's drift since the line's
    samples, and the line's own error there: the two differ by serving alone); none without
    reference steps (a GPU)."""
    by = {}
    for n, x in reference:
        by.setdefault(n, []).append(x)
    if not by:
        return list(over)
    drift = {n: statistics.median(xs) for n, xs in by.items()}
    return [(n, x - drift[min(drift, key=lambda b: (abs(b - n), b))]) for n, x in over]


def _over_line(steps: list[list], step: StepModel) -> list[tuple[int, float]]:
    """(sequences, seconds over the step line) of decode steps listed as _decode_steps lists them."""
    return [(n, seconds - step.seconds(Step([], contexts, shared))) for n, seconds, contexts, shared in steps]


def serving_fit(extra: list[tuple[int, float]]) -> dict:
    """fixed + per sequence through the per-batch medians of (batch, seconds serving added), over
    the batch sizes that hold at least MIN_BATCH_SHARE of the steps: the sizes the streams were
    asked for, not the few steps between them as streams start and finish (single steps that
    would carry as much of the fit as a size's hundred)."""
    counts = Counter(n for n, _ in extra)
    line = _line([(n, x) for n, x in extra if counts[n] >= MIN_BATCH_SHARE * len(extra)])
    return {"fixed_s": line["fixed_s"], "per_sequence_s": line["per_token_s"], "samples": extra}


def prefill_serving(
    prefills: list[tuple[int, float]], follow_ups: list[float], step: StepModel, prompt: int, follow_up: tuple
) -> dict:
    """What serving adds to a served prefill over the step line's time: fixed_s seconds per
    prompt, a share `fixed` of the line's time, and a share per sequence decoding beside it (on a
    prefill node the router relays their tokens on a core it shares). fixed_s and fixed go through
    two lone prompts' medians, a long one's and a follow-up's (each >= 0): a share alone would
    price what serving adds to a short prefill by a long one's (in `pdserve colocated` at two
    threads on AVX512_BF16: 45 ms a prompt, 7% of a 600-token prompt's line, a third of a follow-up's)."""
    alone = step.seconds(Step([(prompt, 0)], []))
    short = step.seconds(Step([follow_up], []))
    long_s = statistics.median(s for b, s in prefills if b == 0)
    short_s = statistics.median(follow_ups)
    share, fixed_s = _through(((alone, long_s), (short, short_s)))
    line = _line([(batch, seconds / alone - 1) for batch, seconds in prefills])  # its slope: per sequence
    return {
        "fixed_s": fixed_s,
        "fixed": share,
        "per_sequence": line["per_token_s"],
        "samples": prefills,
        "follow_up": list(follow_up),
        "follow_up_samples": follow_ups,
    }


def _through(points: tuple) -> tuple[float, float]:
    """(share, fixed_s) with measured = line x (1 + share) + fixed_s through two (line, measured)
    points, each >= 0: where the two points ask for a negative one, the other alone, fitted to both."""
    (a, y), (b, z) = points
    share = (y - z) / (a - b) - 1 if a != b else -1.0
    fixed_s = z - b * (1 + share)
    if share >= 0 and fixed_s >= 0:
        return share, fixed_s
    if share < 0:
        return 0.0, max(0.0, statistics.fmean([y - a, z - b]))
    return max(0.0, statistics.fmean([y / a, z / b]) - 1), 0.0


def _line(samples: list[tuple[int, float]]) -> dict:
    """fixed + per_token x tokens through per-size medians (>= 0)."""
    by = {}
    for n, s in samples:
        by.setdefault(n, []).append(s)
    xs = sorted(by)
    ys = [statistics.median(by[x]) for x in xs]
    if len(xs) < 2:
        return {"fixed_s": max(ys[0], 0.0), "per_token_s": 0.0}
    slope = max(0.0, statistics.linear_regression(xs, ys).slope)
    fixed = max(0.0, statistics.fmean(ys) - slope * statistics.fmean(xs))
    return {"fixed_s": fixed, "per_token_s": slope}


def machine(device: str) -> dict:
    """What the profile was measured on: the CPU's class and cores, and the GPU where the engine ran on one."""
    from engine.hardware import cpu_features, resolve_device

    found = {"isa": cpu_features().isa, "arch": platform.machine(), "cores": os.cpu_count()}
    where = resolve_device(device)
    return found | ({"gpu": torch.cuda.get_device_name(where)} if where.type == "cuda" else {})


def profile(
    model: str,
    dtype: str,
    device: str,
    threads: list[int],
    repeat: int,
    quick: bool,
    kv_cache_bytes: int = EngineConfig.kv_cache_bytes,
) -> dict:
    began = time.monotonic()
    engines = {}
    for t in threads:
        config = EngineConfig(model=model, dtype=dtype, device=device, num_threads=t, kv_cache_bytes=kv_cache_bytes)
        engines[str(t)] = profile_steps(config, repeat, quick)
        if torch.cuda.is_available():  # the engine is gone: its KV cache's memory goes to the nodes' processes
            gc.collect()
            torch.cuda.empty_cache()
    result = {
        "version": VERSION,
        "model": model,
        "device": device,
        "machine": machine(device),
        "date": time.strftime("%Y-%m-%d"),
        "engines": engines,
    }
    result |= asyncio.run(profile_serving(model, dtype, device, threads, repeat, quick))
    streams, prompt = result.pop("streams"), result.pop("stream_prompt")
    one_thread = engines.get("1")  # the nodes ran one thread each
    prefills, follow_ups, follow_up = result.pop("prefills"), result.pop("follow_ups"), result.pop("follow_up")
    result["serving"] = serving_overhead(streams, StepModel(**one_thread["step"])) if one_thread else NO_OVERHEAD
    result["prefill_serving"] = (
        prefill_serving(prefills, follow_ups, StepModel(**one_thread["step"]), prompt, follow_up)
        if one_thread
        else NO_SHARE
    )
    result["colocated_serving"] = {
        t: serving_overhead(s, StepModel(**engines[t]["step"])) for t, s in result.pop("colocated_streams").items()
    }
    result["colocated_prefill_serving"] = {
        t: prefill_serving(lone, ups, StepModel(**engines[t]["step"]), prompt, follow_up)
        for t, (lone, ups) in result.pop("colocated_prefills").items()
    }
    result["seconds"] = round(time.monotonic() - began, 1)
    return result


def provenance(prof: dict, began: float) -> dict:
    """What a result computed from a profile says of how it was made (began: time.monotonic())."""
    return {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.monotonic() - began),
        "profile": {k: prof[k] for k in ("model", "machine", "date")}
        | {"dtype": next(iter(prof["engines"].values()))["dtype"]},
    }
