"""The router: the public Generation service in front of the prefill and decode pools.

It tokenizes and checks requests, picks a prefill node and a decode node, and relays tokens.
It never touches KV bytes: the decode node reads them from the prefill node directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

import kvtransfer.transports as kv_transports
from engine.sampling_params import SamplingParams
from kvtransfer.base import Capabilities
from kvtransfer.security import NONE, Security
from pdserve_api import common_pb2, generate_pb2, generate_pb2_grpc, nodes_pb2
from router.config import RouterConfig
from router.frontend import Frontend, RequestError, remaining
from router.placement import Placement
from router.pool import Endpoint, EndpointPool, NoHealthyNode
from router.request import PrefillFailed, Request, as_part, next_reply
from serving.grpc_server import GrpcServer
from serving.metrics import Metrics
from serving.protocol import sampling_to_proto

log = logging.getLogger(__name__)
MIGRATIONS = 3  # times one request may move to another decode node
PREFILL_ATTEMPTS = 3  # prefill nodes one attempt tries while they cannot be reached
HOLD_RECHECK_S = 1.0  # a request held for a place (Decision.hold) decides again at least this often
GENERATION = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# A decode call's failures that move the request elsewhere: a dead node, KV unreadable or corrupt;
# CANCELLED: the node cancelled it (a node stopping at once; a cancel of ours never gets here).
MIGRATE_ON = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}


class Router(Frontend):
    def __init__(
        self,
        model: str,
        prefill: list[str],
        decode: list[str],
        config: RouterConfig = RouterConfig(),
        *,
        host: str = "127.0.0.1",
        check_interval_s: float = 1.0,
        metrics: Metrics | None = None,
        internal_security: Security = NONE,
        public_security: Security | None = None,
        any_port_if_taken: bool = False,
    ):
        """config: the router's options (router/config.py). public_security: the public port's
        TLS and API keys or token (default: config's files); API keys guard both public APIs,
        gRPC metadata and the HTTP header `authorization: Bearer <key>`."""
        super().__init__(
            model,
            config.max_model_len,
            metrics,
            config.max_outstanding,
            config.rate_limit,
            chat_template=config.chat_template,
            tool_call_parser=config.tool_call_parser,
        )
        public = public_security or config.public_security()
        self.config = config
        self.placement = Placement(
            config.local_prefill,
            config.max_local_prefill_tokens,
            late_binding=config.late_binding,
            max_local_tpot_s=config.max_local_prefill_tpot,
        )
        self._prefill_ended = asyncio.Event()  # set (and replaced) as each prefill ends: held requests look again
        self.api_keys, self._http = public.api_keys, None
        self._serving: bool | None = None  # what the gRPC health service last said
        self._tasks: set[asyncio.Task] = set()
        self.prefill_pool = EndpointPool(
            "prefill",
            prefill,
            check_interval_s,
            security=internal_security,
            on_change=self._follow_pools,
            affinity_tokens=config.cache_affinity_tokens,
        )
        self.decode_pool = EndpointPool(
            "decode", decode, check_interval_s, security=internal_security, on_change=self._follow_pools
        )
        self.server = GrpcServer(host, config.port, public, any_port_if_taken)
        self.server.add(
            generate_pb2_grpc.add_GenerationServicer_to_server,
            self,
            generate_pb2.DESCRIPTOR.services_by_name["Generation"],
        )

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def http_address(self) -> str | None:
        return f"{self.server.host}:{self._http[2]}" if self._http else None

    async def start(self) -> None:
        await asyncio.gather(self.prefill_pool.start(), self.decode_pool.start())
        await self.server.start()  # says SERVING: correct it at once
        self._serving = None
        await self._follow_pools()
        if self.config.http_port is not None:
            from router.openai_api import OpenAIAPI, build_app, serve_http

            self._http = await serve_http(
                build_app(OpenAIAPI(self, self.api_keys)), self.server.host, self.config.http_port
            )

    async def stop(self, grace: float = 1.0) -> None:
        if self._http:
            self._http[0].should_exit = True
            await self._http[1]
        await self.server.stop(grace)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(self.prefill_pool.close(), self.decode_pool.close())

    def health(self) -> dict:
        """Unavailable while a pool it needs has no healthy node: the decode pool always, the
        prefill pool only with local prefill off (else the decode node prefills, as _place does;
        `pdserve up --prefill 0` has no prefill node at all)."""
        pools = (self.prefill_pool, self.decode_pool)
        needed = pools if self.placement.mode == "off" else (self.decode_pool,)
        missing = [p.no_healthy_node() for p in needed if not p.healthy()]
        report = {"status": "unavailable" if missing else "ok"}
        if missing:
            report["message"] = "; ".join(missing)
        for p in pools:
            report[p.role] = {"healthy": len(p.healthy()), "nodes": len(p.endpoints)}
        return report

    async def _follow_pools(self) -> None:
        """The gRPC health ("" and the Generation service) says NOT_SERVING while `health` says
        unavailable; `liveness` stays SERVING (serving/grpc_server.py)."""
        serving = self.health()["status"] == "ok"
        if serving != self._serving:
            self._serving = serving
            await self.server.set_serving(serving, ["", GENERATION])

    # ---- a request's life ---------------------------------------------------------------
    async def _serve(
        self, request: generate_pb2.GenerateRequest, deadline: float = 0.0
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """1. check; then attempts until one ends the request: 2. pick a decode node and place the
        prefill, remote on a prefill node or, for a short uncached suffix, local on the decode node
        (router/placement.py), 3. prefill, 4. decode and stream, with usage and timings at the end.
        If the decode side fails (its node dies, the KV cannot be read or is corrupt) the request
        migrates: the next attempt prefills prompt + every token streamed so far and decodes
        elsewhere, so the client's stream goes on with no token missing or repeated. Raises
        RequestError; deadline is unix seconds (0: none)."""
        timings = common_pb2.Timings(queued=time.time())
        prompt, params = self._check(request)  # 1. check
        r = Request(uuid.uuid4().hex, prompt, params, deadline, timings, label=request.request_id)
        for attempt in range(MIGRATIONS + 1):
            decode, plan, prefill = await self._place(r)  # 2. place
            began = time.time()
            run = (
                self._local_attempt(r, attempt, decode, plan)
                if plan.local
                else self._remote_attempt(r, attempt, decode, prefill, plan, began)
            )
            try:
                async with contextlib.aclosing(run):  # its calls end, and its KV is freed, with it
                    async for msg in run:  # 3. prefill, 4. decode and stream
                        yield msg
                        if msg.finished:
                            return
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "decode stream ended early")
            except PrefillFailed as e:  # nothing streamed yet; the next attempt places the prefill anew
                stuck = self.placement.mode == "off" and not self.prefill_pool.healthy({e.node.address})
                if e.code != grpc.StatusCode.UNAVAILABLE or attempt == MIGRATIONS or stuck or r.past_deadline():
                    more = f" ({self.prefill_pool.no_healthy_node()})" if stuck else ""
                    raise RequestError(e.code, f"prefill: {e.details}{more}") from None
                log.warning(
                    "request %s (%s): prefill on %s failed (%s); retrying", r.rid, r.label, e.node.address, e.details
                )
                e.node.healthy = False  # until a health check passes again
            except grpc.aio.AioRpcError as e:
                await self._migrate(r, attempt, decode, e)

    async def _remote_attempt(
        self, r: Request, attempt: int, decode: Endpoint, prefill: Endpoint | None, plan, began: float
    ):
        """The prefill pool computes the prompt (its KV leased there) and the first token, which
        streams at once; the decode node reads the KV and decodes. Layer-wise, the decode call
        starts as soon as the KV is described and the first token comes after the last layer."""
        self.metrics.inc("pdserve_prefills_total", where="remote")
        num_tokens = len(r.tokens)
        sampling = sampling_to_proto(r.params)
        if r.several:  # its KV only: one prefill, one transfer, every sample's first token on the decode node
            sampling = sampling_to_proto(
                SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, cache_salt=r.params.cache_salt)
            )
        ask = nodes_pb2.PrefillRequest(
            request_id=r.rid,
            prompt_token_ids=r.prompt,
            sampling=sampling,
            deadline=r.deadline,
            output_token_ids=r.generated,
            num_emitted_chars=r.emitted,
        )
        stream = not r.ends_at_next_token  # a token that may end the request hands on no KV to stream
        prefill, reply, replies, alone = await self._prefill(ask, decode, prefill, plan.remote_tokens, stream)
        kv, call, read = reply.kv, None, False  # read: the decode node streams, so it read and released the KV
        try:
            with decode.track(), self._outstanding(decode):
                if kv.layerwise:  # the decode node reads each layer as it is written
                    call = self._decode(decode, r, attempt, kv)
                    reply = await next_reply(replies, prefill)  # the first token
                r.prefilled(reply, prefill.address, local=False)
                self._background(self.prefill_pool.refresh(prefill))  # the blocks it just named
                if not r.several:
                    head = r.message(as_part(reply))
                    yield head
                    if head.finished:
                        return
                call, last = call or self._decode(decode, r, attempt, kv), None
                async for part in call:
                    last = _token_gap(decode, r, part, last)
                    if not read:
                        read = True
                        r.transferred(part)
                        r.decoding_on(decode.address)
                        self._measured_remote(num_tokens, reply, part, began, alone)
                    yield r.message(part)
        finally:
            self._end_calls(decode if read else None, call, replies)
            if not read and kv.lease_id and not reply.finished:  # nobody read the KV: free it now
                await asyncio.shield(self._release_kv(prefill, kv))

    async def _local_attempt(self, r: Request, attempt: int, decode: Endpoint, plan):
        """Conditional disaggregation: the decode node computes the suffix its cache lacks, then
        decodes; its first message carries the first token."""
        self.metrics.inc("pdserve_prefills_total", where="local")
        call, streamed = None, False
        try:
            with decode.track(), self._outstanding(decode):
                with self._prefilling(decode, plan.local_tokens) as alone:
                    call = self._decode(decode, r, attempt, None)
                    first = await call.read()
                if first is grpc.aio.EOF:
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNAVAILABLE, None, None, "decode stream ended before the first token"
                    )
                streamed, last = True, _token_gap(decode, r, first, None)
                r.prefilled(first, decode.address, local=True)
                r.decoding_on(decode.address)
                self.placement.measured_local(
                    len(r.tokens) - first.cached_tokens, first.prefill_end - first.prefill_start, alone
                )
                yield r.message(first)
                while (part := await call.read()) is not grpc.aio.EOF:  # (read() once: never `async for`)
                    last = _token_gap(decode, r, part, last)
                    yield r.message(part)
        finally:
            self._end_calls(decode if streamed else None, call)

    async def _migrate(self, r: Request, attempt: int, decode: Endpoint, e: grpc.aio.AioRpcError) -> None:
        """After a decode side failed: raises RequestError unless the request may move (returns)."""
        if r.several and r.generated and e.code() in MIGRATE_ON:  # n > 1, beams: forked on the node that died
            raise RequestError(
                e.code(),
                f"decode node {decode.address} failed after the samples began "
                f"({e.details()}); requests with n, best_of or beam_width > 1 do not "
                "migrate (every sample forked there): retry the request",
            ) from None
        if e.code() not in MIGRATE_ON or attempt == MIGRATIONS or r.past_deadline():
            raise RequestError(e.code(), f"decode: {e.details()}") from None
        log.warning(
            "request %s (%s): decode on %s failed (%s: %s) after %d tokens; migrating",
            r.rid,
            r.label,
            decode.address,
            e.code().name,
            e.details(),
            len(r.generated),
        )
        self.metrics.inc("pdserve_migrations_total")
        r.timings.migrations += 1
        await self.decode_pool.check(decode)  # a dead node leaves the pool now

    # ---- steps ------------------------------------------------------------------------------
    async def _prefill(
        self, ask: nodes_pb2.PrefillRequest, decode: Endpoint, prefill: Endpoint | None, num_tokens: int, stream: bool
    ):
        """Returns (prefill node, its first answer, the rest of a layer-wise answer or None, whether
        it ran alone there). prefill: the node to try first (None: pick one, cache-aware);
        num_tokens: what it computes; stream: layer by layer where the two nodes do (layerwise).
        Prefill has no effect but a lease that expires, so a node that cannot be reached (gone,
        restarting) is retried on another; with none left, PrefillFailed: the request's next
        attempt places it anew (on the decode node, unless local prefill is off). Other errors
        are the request's."""
        tried: set[str] = set()
        tokens = list(ask.prompt_token_ids) + list(ask.output_token_ids)
        while True:
            prefill = prefill or _pick(self.prefill_pool, tried, tokens, ask.sampling.cache_salt)
            try:
                with prefill.track(), self._outstanding(prefill), self._prefilling(prefill, num_tokens) as alone:
                    if not (stream and self.layerwise(prefill, decode)):
                        return prefill, await prefill.stub.Prefill(ask, timeout=remaining(ask.deadline)), None, alone
                    replies = prefill.stub.StreamPrefill(ask, timeout=remaining(ask.deadline))
                    return prefill, await next_reply(replies, prefill, raw=True), replies, alone
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise RequestError(e.code(), f"prefill: {e.details()}") from None
                prefill.healthy = False  # until a health check passes again
                tried.add(prefill.address)
                if len(tried) >= PREFILL_ATTEMPTS or not self.prefill_pool.healthy(tried):  # the next attempt
                    raise PrefillFailed(e.code(), e.details(), prefill) from None  # may prefill locally
                log.warning("prefill node %s unreachable (%s); retrying elsewhere", prefill.address, e.details())
                prefill = None

    async def _place(self, r: Request):
        """The decode node (where the chat is, cache-aware), where the request's prefill runs
        (router/placement.py), and the prefill node that would run it remotely. A request whose
        place is a decode node already prefilling one of this router's is held, and picked and
        placed again when a prefill ends (late binding: Placement's docstring), until its deadline."""
        while True:
            decode = _pick(self.decode_pool, prompt=r.tokens, cache_salt=r.params.cache_salt)
            plan, prefill = await self._decide(decode, r.tokens, r.params.cache_salt)
            if not plan.hold:
                return decode, plan, prefill
            if r.past_deadline():
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while waiting for a prefill")
            ended = self._prefill_ended
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), min(HOLD_RECHECK_S, remaining(r.deadline) or HOLD_RECHECK_S))

    async def _decide(self, decode: Endpoint, tokens: list[int], salt: str):
        """Where the prefill runs, and the prefill node that would run it remotely (None: no
        healthy one; then the decode node does, if it may)."""
        try:
            prefill = self.prefill_pool.pick(prompt=tokens, cache_salt=salt)
        except NoHealthyNode:
            prefill = None
        if self.placement.mode == "auto":
            await self.decode_pool.settled(decode)
        decode_cached = self.decode_pool.cached_tokens(decode, tokens, salt)
        prefill_cached = self.prefill_pool.cached_tokens(prefill, tokens, salt) if prefill else 0
        # the decode node reads only the blocks it lacks where its transport can, with one block size
        read = self.kv_read(prefill, decode) if prefill else None
        partial = read is not None and read.partial and prefill.load.block_size == decode.load.block_size
        plan = self.placement.decide(
            len(tokens),
            decode_cached,
            prefill_cached,
            moved=len(tokens) - (decode_cached if partial else 0),
            prefill_queued=prefill.prefill_tokens if prefill else 0,
            local_queued=decode.prefill_tokens,
            decode_running=decode.outstanding,
            prefill_node=prefill is not None,
            decode_tpot_s=decode.token_gaps.tpot_s,
        )
        if decode.token_gaps.tpot_s is not None:
            self.metrics.set("pdserve_decode_node_tpot_seconds", decode.token_gaps.tpot_s, node=decode.address)
        log.debug(
            "placement: %s (decode node caches %d of %d tokens, %d decoding there)",
            plan,
            decode_cached,
            len(tokens),
            decode.outstanding,
        )
        return plan, prefill

    @staticmethod
    def kv_read(prefill: Endpoint, decode: Endpoint, layerwise: bool = False) -> Capabilities | None:
        """The transport the decode node would read the prefill node's KV with, as both report
        theirs (kvtransfer/transports.py), and what it can do there."""
        senders = [Capabilities.from_proto(t) for t in prefill.load.kv_transports]
        readers = [Capabilities.from_proto(t) for t in decode.load.kv_transports]
        return kv_transports.choose(senders, readers, prefill.load.host_id == decode.load.host_id, layerwise)

    def layerwise(self, prefill: Endpoint, decode: Endpoint) -> bool:
        """Whether to stream the KV layer by layer: on, where some transport between the two can;
        auto, where the one the decode node reads with does (across hosts: tcp; on one host shared
        memory moves the whole KV in a few milliseconds)."""
        if self.config.kv_layerwise == "off":
            return False
        read = self.kv_read(prefill, decode, layerwise=self.config.kv_layerwise == "on")
        return read is not None and read.layerwise

    def _measured_remote(self, num_tokens: int, reply, part, began: float, alone: bool) -> None:
        """What the placement learns from a remote attempt (num_tokens: its prompt and tokens so far)."""
        prefill_s = reply.prefill_end - reply.prefill_start
        transfer_s = part.transfer_end - part.transfer_start
        handoff_s = part.decode_admitted - began - prefill_s - transfer_s  # hops, queues, admission
        self.placement.measured_remote(
            num_tokens - reply.cached_tokens,
            prefill_s,
            transfer_s,
            moved=num_tokens - part.cached_tokens,
            handoff_s=handoff_s,
            alone=alone,
        )

    def _end_calls(self, refresh: Endpoint | None, *calls) -> None:
        if refresh is not None:
            self._background(self.decode_pool.refresh(refresh))  # what its cache holds now
        for c in calls:
            if c is not None and not c.done():
                c.cancel()  # a cancelled client, or a deadline: the nodes stop and free

    def _background(self, task: asyncio.Task) -> None:
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _decode(decode: Endpoint, r: Request, attempt: int, kv: nodes_pb2.KVSource | None):
        """The Decode call; kv None: the decode node prefills locally. n > 1 and beams: every
        sample's first token is drawn there, so it gets no token of the prefill's."""
        generated, emitted = ([], 0) if r.several else (r.generated, r.emitted)
        return decode.stub.Decode(
            nodes_pb2.DecodeRequest(
                request_id=f"{r.rid}#{attempt}",
                prompt_token_ids=r.prompt,
                output_token_ids=generated,
                sampling=sampling_to_proto(r.params),
                kv=kv,
                deadline=r.deadline,
                num_emitted_chars=emitted,
                prefill_locally=kv is None,
            ),
            timeout=remaining(r.deadline),
        )

    @contextlib.contextmanager
    def _prefilling(self, endpoint: Endpoint, tokens: int):
        """endpoint.prefill(tokens); as it ends, the requests held for a place decide again."""
        try:
            with endpoint.prefill(tokens) as alone:
                yield alone
        finally:
            self._prefill_ended.set()
            self._prefill_ended = asyncio.Event()

    @contextlib.contextmanager
    def _outstanding(self, endpoint: Endpoint):
        role = "prefill" if endpoint in self.prefill_pool.endpoints else "decode"
        self.metrics.set("pdserve_node_outstanding_requests", endpoint.outstanding, role=role, node=endpoint.address)
        try:
            yield
        finally:
            self.metrics.set(
                "pdserve_node_outstanding_requests", endpoint.outstanding - 1, role=role, node=endpoint.address
            )

    @staticmethod
    async def _release_kv(prefill: Endpoint, kv: nodes_pb2.KVSource) -> None:
        try:
            request = nodes_pb2.ReleaseKVRequest(lease_id=kv.lease_id, access_key=kv.access_key)
            await prefill.stub.ReleaseKV(request, timeout=5)
        except grpc.aio.AioRpcError as e:  # the lease expires on its own
            log.warning("ReleaseKV on %s failed: %s", prefill.address, e.code().name)


def _pick(
    pool: EndpointPool, exclude: set[str] = frozenset(), prompt: list[int] | None = None, cache_salt: str = ""
) -> Endpoint:
    try:
        return pool.pick(exclude, prompt, cache_salt)
    except NoHealthyNode as e:
        raise RequestError(grpc.StatusCode.UNAVAILABLE, str(e)) from None


def _token_gap(decode: Endpoint, r: Request, part, last: float | None) -> float | None:
    """A decode node's message arrived: counts its gap since the stream's last one (`last`,
    monotonic; None: its first) in the node's token gaps, except where samples or beams
    interleave in one stream (n > 1). Returns now (last, for a message without tokens)."""
    if not part.token_ids:  # (a final message without a token)
        return last
    now = time.monotonic()
    if last is not None and not r.several:
        decode.token_gaps.add(now - last, len(part.token_ids))
    return now
