"""A pool of node endpoints (prefill or decode): least-outstanding choice and health checks.

A node is chosen by the fewest requests this router has in flight on it, then by the load it
last reported (waiting + running sequences), then round robin. Cache-aware, for a prompt: each
node reports the names of the prefix blocks its cache holds (changes since the router's last
look, with every health check and after each request it served), and a node's cached share of
the prompt counts against its load: a conversation stays on the node holding its history until
`affinity_tokens` cached tokens no longer outweigh one more request in flight there. A node that fails
`failure_threshold` health checks in a row (or answers NOT_SERVING) gets no new requests until
a check passes again. A check that only runs past its deadline is a failure once the node has
answered none for `unresponsive_s` (a hung node): a busy node, or a router whose own event loop
is busy, answers late, and a dead node refuses at once anyway. `on_change` is awaited after each
round of checks and each update, so the router's own health can follow its pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.block_manager import block_hashes
from kvtransfer.security import INTERNAL_CHANNEL_OPTIONS, NONE, Security
from pdserve_api import common_pb2, nodes_pb2_grpc

log = logging.getLogger(__name__)
AFFINITY_TOKENS = 512  # cached prompt tokens on a node worth one more request in flight there
UNRESPONSIVE_S = 10.0  # a node that answered no health check for this long is hung, not busy
# A node removed from the pool keeps its channel this long once idle: a call still in flight on a
# closed channel raises CancelledError in its caller (a request migrating off a dead node hung so).
RETIRED_GRACE_S = 60.0
TOKEN_GAPS = 32  # a decode node's recent time per output token: over this many gaps (TokenGaps)


class TokenGaps:
    """A decode node's recent time per output token, as the router sees its streams: over the
    last TOKEN_GAPS gaps between one stream's messages (across its streams), their seconds over
    the tokens they brought (speculation sends several a message), as a request's TPOT is taken.
    The router times its relay: a client that reads slowly, or a busy event loop, shows in them."""

    def __init__(self):
        self.gaps: deque[tuple[float, int]] = deque(maxlen=TOKEN_GAPS)

    def add(self, seconds: float, tokens: int = 1) -> None:
        if tokens > 0:
            self.gaps.append((seconds, tokens))

    @property
    def tpot_s(self) -> float | None:
        return sum(s for s, _ in self.gaps) / sum(n for _, n in self.gaps) if self.gaps else None


class NoHealthyNode(RuntimeError):
    pass


@dataclass
class Endpoint:
    address: str
    channel: grpc.aio.Channel
    stub: object  # PrefillNodeStub or DecodeNodeStub
    healthy: bool = False
    outstanding: int = 0
    failures: int = 0
    load: common_pb2.NodeLoad = field(default_factory=common_pb2.NodeLoad)
    cached: set[int] = field(default_factory=set)  # names of the prefix blocks its cache holds
    cache_version: int = 0
    prefilling: int = 0  # this router's prefills in flight there (on a decode node: local ones)
    prefill_tokens: int = 0  # and the tokens they compute
    refreshing: asyncio.Task | None = None  # a GetLoad in flight (EndpointPool.refresh)
    retired_at: float | None = None  # when update() removed it from the pool
    last_answer: float = field(default_factory=time.monotonic)  # when a health check last answered
    token_gaps: TokenGaps = field(default_factory=TokenGaps)  # on a decode node: its streams' (router/placement.py)

    def apply_load(self, load: common_pb2.NodeLoad) -> None:
        """Takes a GetLoad answer: the counters, and the changes to the node's prefix cache."""
        self.load = load
        if load.cache_snapshot:
            self.cached = set(load.cached_added)
        else:
            self.cached.update(load.cached_added)
            self.cached.difference_update(load.cached_removed)
        self.cache_version = load.cache_version

    def cached_tokens(self, names_by_block_size: dict[int, list[int]]) -> int:
        """How many leading tokens of a prompt (given as its block names per block size) it holds."""
        names = names_by_block_size.get(self.load.block_size, ())
        n = 0
        while n < len(names) and names[n] in self.cached:
            n += 1
        return n * self.load.block_size

    @contextlib.contextmanager
    def prefill(self, tokens: int):
        """Counts a prefill of `tokens` uncached tokens in flight here; yields whether it is alone."""
        alone = self.prefilling == 0
        self.prefilling += 1
        self.prefill_tokens += tokens
        try:
            yield alone
        finally:
            self.prefilling -= 1
            self.prefill_tokens -= tokens

    @contextlib.contextmanager
    def track(self):
        self.outstanding += 1
        try:
            yield self
        finally:
            self.outstanding -= 1


class EndpointPool:
    def __init__(
        self,
        role: str,
        addresses: list[str],
        check_interval_s: float = 1.0,
        failure_threshold: int = 2,
        security: Security = NONE,
        on_change: Callable[[], Awaitable[None]] | None = None,
        affinity_tokens: int = AFFINITY_TOKENS,
        unresponsive_s: float = UNRESPONSIVE_S,
    ):
        self.unresponsive_s = unresponsive_s
        self.affinity_tokens = affinity_tokens
        self.security = security
        self.stub_cls = {"prefill": nodes_pb2_grpc.PrefillNodeStub, "decode": nodes_pb2_grpc.DecodeNodeStub}[role]
        self.role = role
        self.endpoints: list[Endpoint] = [self._endpoint(a) for a in addresses]
        self.retired: list[Endpoint] = []  # removed from the pool, channel open until idle
        self.check_interval_s = check_interval_s
        self.failure_threshold = failure_threshold
        self._turn = itertools.count()
        self._task: asyncio.Task | None = None
        self.on_change = on_change
        self.closed = False

    def _endpoint(self, address: str) -> Endpoint:
        channel = self.security.channel(address, INTERNAL_CHANNEL_OPTIONS)
        return Endpoint(address, channel, self.stub_cls(channel))

    async def update(self, addresses: list[str]) -> None:
        """Makes the pool exactly these nodes (discovery, e.g. through Ray). New nodes are checked
        before they get work; a removed node gets no new work and its channel closes once its
        in-flight requests are done."""
        known = {e.address for e in self.endpoints}
        new = [self._endpoint(a) for a in addresses if a not in known]
        gone = [e for e in self.endpoints if e.address not in set(addresses)]
        for e in gone:
            e.healthy, e.retired_at = False, time.monotonic()
        self.endpoints = [e for e in self.endpoints if e not in gone] + new
        self.retired += gone
        await asyncio.gather(*(self._check(e) for e in new))
        await self._close_retired()
        await self._changed()

    async def _close_retired(self, grace_s: float = RETIRED_GRACE_S) -> None:
        """Closes the channels of removed nodes that have been idle a while (no request, no load
        refresh, removed grace_s ago: longer than any check's deadline)."""
        now = time.monotonic()
        for e in [
            e
            for e in self.retired
            if e.outstanding == 0 and now - e.retired_at >= grace_s and (e.refreshing is None or e.refreshing.done())
        ]:
            self.retired.remove(e)
            await e.channel.close()

    def healthy(self, exclude: set[str] = frozenset()) -> list[Endpoint]:
        return [e for e in self.endpoints if e.healthy and e.address not in exclude]

    def no_healthy_node(self) -> str:
        return (
            f"no healthy {self.role} node (of {len(self.endpoints)}: "
            f"{', '.join(e.address for e in self.endpoints) or 'none configured'})"
        )

    def pick(self, exclude: set[str] = frozenset(), prompt: list[int] | None = None, cache_salt: str = "") -> Endpoint:
        healthy = self.healthy(exclude)
        if not healthy:
            raise NoHealthyNode(self.no_healthy_node())
        turn = next(self._turn)
        names: dict[int, list[int]] = {}
        if prompt and self.affinity_tokens:
            for size in {e.load.block_size for e in healthy if e.cached and e.load.block_size}:
                names[size] = block_hashes(prompt[:-1], size, cache_salt)  # the last token is always computed

        def cost(e: Endpoint) -> float:
            return e.outstanding - (e.cached_tokens(names) / self.affinity_tokens if names else 0.0)

        return min(
            healthy,
            key=lambda e: (
                cost(e),
                e.load.num_waiting + e.load.num_running,
                (self.endpoints.index(e) - turn) % len(self.endpoints),
            ),
        )

    def cached_tokens(self, e: Endpoint, prompt: list[int], cache_salt: str = "") -> int:
        """How many leading tokens of the prompt a node's cache holds, as it last reported."""
        if not e.cached or not e.load.block_size:
            return 0
        return e.cached_tokens({e.load.block_size: block_hashes(prompt[:-1], e.load.block_size, cache_salt)})

    def refresh(self, e: Endpoint) -> asyncio.Task:
        """Asks a node for its load and cache changes now (after it served a request); the task is
        kept on the endpoint until done, so that the next choice can wait for it (settled)."""
        e.refreshing = asyncio.create_task(self._refresh(e))
        return e.refreshing

    async def _refresh(self, e: Endpoint) -> None:
        if self.closed or e.retired_at is not None:  # after the pools closed, or the node left the pool
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            e.apply_load(await e.stub.GetLoad(common_pb2.LoadRequest(cache_since=e.cache_version), timeout=1.0))

    @staticmethod
    async def settled(e: Endpoint, timeout: float = 0.05) -> None:
        """Waits (a little) for a refresh of the node in flight: a chat's next turn, sent as soon as
        the last answer arrived, finds the blocks that answer named."""
        if e.refreshing is not None and not e.refreshing.done():
            await asyncio.wait([e.refreshing], timeout=timeout)

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        # Health checks and load refreshes end before their channels close: a GetLoad on a closed
        # channel raises UsageError in a task nobody awaits (seen at `pdserve up` shutdowns).
        self.closed = True
        endpoints = self.endpoints + self.retired
        tasks = [t for t in [self._task] + [e.refreshing for e in endpoints] if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for e in endpoints:
            await e.channel.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            await self.check_all()
            await self._close_retired()

    async def check(self, endpoint: Endpoint) -> None:
        """Checks one node now (after a failure): a dead one leaves the pool at once."""
        if endpoint.retired_at is not None:  # out of the pool already
            return
        endpoint.failures = self.failure_threshold - 1
        await self._check(endpoint)
        await self._changed()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.endpoints))
        await self._changed()

    async def _changed(self) -> None:
        if self.on_change is not None:
            await self.on_change()

    async def _check(self, e: Endpoint) -> None:
        # A busy node answers late, not never: a late answer is not a failure until the node has
        # been silent for unresponsive_s (seen: a 64-client soak on 2 busy cores timed out 1 s checks
        # and took the only prefill node out, failing requests with UNAVAILABLE).
        if self.closed:
            return
        timeout = max(1.0, self.check_interval_s)
        try:
            reply = await health_pb2_grpc.HealthStub(e.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            e.last_answer = time.monotonic()
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            if ok:
                e.apply_load(await e.stub.GetLoad(common_pb2.LoadRequest(cache_since=e.cache_version), timeout=timeout))
        except grpc.aio.AioRpcError as err:
            silent_s = time.monotonic() - e.last_answer
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and e.healthy and silent_s < self.unresponsive_s:
                log.info(
                    "%s node %s is slow to answer its health check (%.1f s since its last answer)",
                    self.role,
                    e.address,
                    silent_s,
                )
                return
            ok = False
        if ok:
            if not e.healthy:
                log.info("%s node %s is healthy", self.role, e.address)
            e.healthy, e.failures = True, 0
        else:
            e.failures += 1
            if e.healthy and e.failures >= self.failure_threshold:
                log.warning("%s node %s failed %d health checks: no new requests", self.role, e.address, e.failures)
                e.healthy = False
