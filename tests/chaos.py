"""Fault scenarios against real node processes (killed by PID) behind an in-process router, and a
soak with random cancellations. Each returns what happened to every request; the tests assert
on it and benchmarks/reliability.py tabulates it (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

import grpc

from pdserve_api import common_pb2, nodes_pb2_grpc
from router.client import AsyncClient
from router.config import RouterConfig
from router.frontend import timeline
from router.server import Router
from serving.launcher import ServerProcess

NODE_FLAGS = ["--dtype", "float32", "--kv-cache-gb", "0.02", "--block-size", "4", "--num-threads", "1"]


@dataclass
class Outcome:
    scenario: str
    sent: int = 0
    completed: int = 0  # with exactly the tokens of a run without the fault
    wrong: int = 0  # completed with other tokens (must be 0)
    failed: dict = field(default_factory=dict)  # clear errors by status
    details: dict = field(default_factory=dict)  # status -> the first error's details, to say why
    lost: int = 0  # neither completed nor failed in time (must be 0)
    cancelled: int = 0
    leaked_blocks: int = 0  # on surviving nodes (must be 0)
    migrations: int = 0
    migration_gap_ms: float = 0.0  # the longest pause a migrated stream saw


class NodeProcess(ServerProcess):
    def __init__(self, role: str, model, env: dict | None = None, extra: list[str] | None = None):
        super().__init__(
            ["-m", f"{role}_node", "--port", "0", "--model", str(model), *NODE_FLAGS, *(extra or [])], env=env
        )
        self.role = role
        self.wait_ready()


async def used_blocks(node: NodeProcess) -> int:
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = (nodes_pb2_grpc.PrefillNodeStub if node.role == "prefill" else nodes_pb2_grpc.DecodeNodeStub)(channel)
        load = await stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
        return load.num_total_blocks - load.num_free_blocks


async def wait_blocks_freed(nodes: list[NodeProcess], timeout_s: float = 45.0) -> int:
    """Leaked blocks on the live nodes once leases had time to expire (0 when all are back)."""
    give_up = time.time() + timeout_s
    while True:
        used = sum([await used_blocks(n) for n in nodes if n.returncode is None])
        if used == 0 or time.time() > give_up:
            return used
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def cluster(model, prefill: int, decode: int, decode_env: dict | None = None, decode_extra=None):
    nodes = [NodeProcess("prefill", model, extra=["--lease-ttl-s", "5"]) for _ in range(prefill)] + [
        NodeProcess("decode", model, decode_env, decode_extra) for _ in range(decode)
    ]
    router = Router(
        str(model),
        [n.address for n in nodes if n.role == "prefill"],
        [n.address for n in nodes if n.role == "decode"],
        RouterConfig(port=0),
        check_interval_s=0.3,
    )
    await router.start()
    try:
        yield router, nodes
    finally:
        await router.stop(0)
        for n in nodes:
            n.stop()


async def run_requests(
    router: Router,
    prompts: list[list[int]],
    expected: list[list[int]],
    max_tokens: int,
    outcome: Outcome,
    on_progress=None,
    timeout_s: float = 90.0,
) -> None:
    """Sends every prompt at once; records completed / failed / lost; on_progress(tokens_per_stream)."""
    progress = [0] * len(prompts)
    gaps = [0.0] * len(prompts)

    async def one(i, client):
        last = time.perf_counter()
        tokens = []
        async for part in client.stream(prompts[i], max_tokens=max_tokens, temperature=0, ignore_eos=True):
            now = time.perf_counter()
            gaps[i] = max(gaps[i], now - last)
            last = now
            tokens += part.token_ids
            progress[i] = len(tokens)
            if on_progress is not None:
                on_progress(progress)
        return tokens

    async with AsyncClient(router.address, timeout=timeout_s) as client:
        tasks = [asyncio.create_task(one(i, client)) for i in range(len(prompts))]
        outcome.sent += len(prompts)
        done, pending = await asyncio.wait(tasks, timeout=timeout_s + 5)
        for task in pending:
            task.cancel()
            outcome.lost += 1
        for i, task in enumerate(tasks):
            if task not in done:
                continue
            if task.exception() is not None:
                code = getattr(task.exception(), "code", lambda: None)()
                key = code.name if code else type(task.exception()).__name__
                outcome.failed[key] = outcome.failed.get(key, 0) + 1
            elif task.result() == expected[i]:
                outcome.completed += 1
            else:
                outcome.wrong += 1
    outcome.migrations = int(router.metrics.sample("pdserve_migrations_total"))
    outcome.migration_gap_ms = max(gaps) * 1e3


async def prefill_dies(model, prompts, expected, max_tokens, transport: str = "auto") -> Outcome:
    """Two prefill nodes; one is killed while prompts are being prefilled (with tcp, while the
    decode node reads their KV layer by layer)."""
    out = Outcome(f"prefill node killed during prefill ({transport})")
    async with cluster(model, 2, 1, decode_extra=["--kv-transport", transport]) as (router, nodes):
        victim = next(e for e in router.prefill_pool.endpoints if e.address == nodes[0].address)

        async def killer():
            # The moment the router has prefills in flight on it (recorded: the kill hit work).
            give_up = time.monotonic() + 60
            while not victim.prefilling and time.monotonic() < give_up:
                await asyncio.sleep(0)
            out.details["prefills_in_flight_at_kill"] = victim.prefilling
            nodes[0].kill()

        await asyncio.gather(killer(), run_requests(router, prompts, expected, max_tokens, out))
        out.leaked_blocks = await wait_blocks_freed(nodes)
    return out


async def prefill_gone_before(model, prompts, expected, max_tokens) -> Outcome:
    """A prefill node dies before any request; the router has not noticed it yet."""
    out = Outcome("prefill node killed before the requests")
    async with cluster(model, 2, 1) as (router, nodes):
        router.prefill_pool.check_interval_s = 3600
        nodes[0].kill()
        await run_requests(router, prompts, expected, max_tokens, out)
        out.leaked_blocks = await wait_blocks_freed(nodes)
    return out


async def transfer_fails(model, prompts, expected, max_tokens, transport: str = "grpc") -> Outcome:
    """The prefill node holding the leased KV dies before the decode node reads it (pulls over
    `transport`, delayed by the fault-injection pause)."""
    out = Outcome(f"prefill node killed during the KV transfer ({transport})")
    async with cluster(
        model, 2, 1, decode_env={"PDSERVE_FAULT_DELAY_TRANSFER_S": "1.0"}, decode_extra=["--kv-transport", transport]
    ) as (router, nodes):
        killed = {}

        def on_progress(progress):
            # First tokens are back: the KV sits in leases, the decode node is about to pull it.
            if not killed and all(p >= 1 for p in progress):
                killed["task"] = asyncio.get_event_loop().create_task(_kill_one_leasing(nodes[:2]))

        await run_requests(router, prompts, expected, max_tokens, out, on_progress)
        out.leaked_blocks = await wait_blocks_freed(nodes)
    return out


async def _kill_one_leasing(prefills: list[NodeProcess]) -> None:
    """Kills the first prefill node that holds leased KV; the other one survives."""
    for node in prefills:
        async with grpc.aio.insecure_channel(node.address) as channel:
            load = await nodes_pb2_grpc.PrefillNodeStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
        if load.num_kv_leases:
            node.kill()
            return


async def decode_dies(model, prompts, expected, max_tokens, transport: str = "auto") -> Outcome:
    """Two decode nodes; one is killed mid-stream. Its requests move to the other."""
    out = Outcome(f"decode node killed mid-stream ({transport})")
    async with cluster(model, 1, 2, decode_extra=["--kv-transport", transport]) as (router, nodes):
        killed = {}

        def on_progress(progress):
            if not killed and min(progress) >= 8:
                killed["yes"] = True
                nodes[1].kill()

        await run_requests(router, prompts, expected, max_tokens, out, on_progress)
        out.leaked_blocks = await wait_blocks_freed(nodes)
    return out


STALL_S = 60.0  # no request in the soak got a message for this long: the ones in flight are stuck


async def soak(
    router: Router,
    nodes,
    num_requests: int,
    concurrency: int,
    cancel_fraction: float,
    seed: int = 0,
    stall_s: float = STALL_S,
) -> Outcome:
    """num_requests at `concurrency` in flight, a fraction cancelled at a random moment.

    A request is lost when it is stuck, not when it is slow: the soak only gives up on the requests
    in flight once none of them has received a message for stall_s (so a busy machine slows it down
    without failing it, and a hung request is caught at the latest stall_s after the others ended).
    The slowest request's time and timeline are recorded in details["slowest"]."""
    out = Outcome(f"soak: {num_requests} requests, {concurrency} concurrent, {cancel_fraction:.0%} cancelled at random")
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    in_flight: set[asyncio.Task] = set()
    last_message = time.monotonic()
    slowest = 0.0

    async def receive(client, prompt, max_tokens) -> None:
        nonlocal last_message, slowest
        started = time.monotonic()
        async for message in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True):
            last_message = time.monotonic()
            if message.finished and last_message - started > slowest:
                slowest = last_message - started
                out.details["slowest"] = f"{slowest:.1f} s: {timeline(message.timings)}"

    async def one(client):
        prompt = [rng.randrange(1, 300) for _ in range(rng.randint(2, 40))]
        cancel_after = rng.random() * 0.2 if rng.random() < cancel_fraction else None
        max_tokens = rng.randint(1, 48)
        async with limit:
            task = asyncio.create_task(receive(client, prompt, max_tokens))
            in_flight.add(task)
            try:
                done, _ = await asyncio.wait([task], timeout=cancel_after)
                if done or cancel_after is None:
                    await task
                    out.completed += 1
                else:
                    task.cancel()
                    out.cancelled += 1
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
                out.lost += 1  # the watchdog gave up on it
            except grpc.aio.AioRpcError as e:
                out.failed[e.code().name] = out.failed.get(e.code().name, 0) + 1
                out.details.setdefault(e.code().name, e.details())
            finally:
                in_flight.discard(task)

    async def watchdog():
        while True:
            await asyncio.sleep(1.0)
            if in_flight and time.monotonic() - last_message > stall_s:
                for task in list(in_flight):
                    task.cancel()

    async with AsyncClient(router.address) as client:
        out.sent = num_requests
        guard = asyncio.create_task(watchdog())
        try:
            await asyncio.gather(*(one(client) for _ in range(num_requests)))
        finally:
            guard.cancel()
    return out
