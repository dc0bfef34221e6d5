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

from engine.sampling_params import SamplingParams
from pdserve.grpc_server import GrpcServer
from pdserve.metrics import Metrics
from pdserve.protocol import sampling_to_proto
from pdserve.security import NONE, Security
from pdserve_api import common_pb2, generate_pb2, generate_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from router.frontend import Frontend, RequestError, final_message, remaining
from router.placement import MAX_LOCAL_TOKENS, Placement
from router.pool import AFFINITY_TOKENS, EndpointPool, NoHealthyNode

log = logging.getLogger(__name__)
PREFILL_ATTEMPTS = 3
KV_LAYERWISE = ("auto", "on", "off")
MIGRATIONS = 3  # times one request may move to another decode node
GENERATION = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# Failures of the decode side after which the request moves (a dead node, KV unreadable or corrupt).
# A decode call's failures that move the request elsewhere. CANCELLED: the node cancelled it (a
# node stopping at once); a cancel of ours ends the request with CancelledError, never here.
MIGRATE_ON = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


class Router(Frontend):
    def __init__(self, model: str, prefill: list[str], decode: list[str], host: str = "127.0.0.1", port: int = 0,
                 max_model_len: int | None = None, check_interval_s: float = 1.0, metrics: Metrics | None = None,
                 public_security: Security = NONE, internal_security: Security = NONE, http_port: int | None = None,
                 kv_layerwise: str = "auto", cache_affinity_tokens: int = AFFINITY_TOKENS,
                 local_prefill: str = "auto", max_local_prefill_tokens: int = MAX_LOCAL_TOKENS, **limits):
        """http_port: also serve the OpenAI-compatible HTTP API (router/openai_api.py) there.
        public_security.api_keys guard both public APIs (none: open): gRPC metadata and the HTTP
        header `authorization: Bearer <key>`. kv_layerwise: auto, on or off (see _layerwise).
        cache_affinity_tokens: cached prompt tokens on a prefill node worth one more request in
        flight there (router/pool.py); 0 ignores the nodes' caches. local_prefill (auto, off,
        always) and max_local_prefill_tokens: conditional disaggregation (router/placement.py)."""
        if cache_affinity_tokens < 0:
            raise ValueError(f"cache_affinity_tokens must be >= 0, got {cache_affinity_tokens}")
        super().__init__(model, max_model_len, metrics, **limits)
        if kv_layerwise not in KV_LAYERWISE:
            raise ValueError(f"kv_layerwise must be one of {KV_LAYERWISE}, got {kv_layerwise!r}")
        self.kv_layerwise = kv_layerwise
        self.placement = Placement(local_prefill, max_local_prefill_tokens)
        self.http_port, self.api_keys, self._http = http_port, public_security.api_keys, None
        self._serving: bool | None = None  # what the gRPC health service last said
        self.prefill_pool = EndpointPool("prefill", prefill, check_interval_s, security=internal_security,
                                         on_change=self._follow_pools, affinity_tokens=cache_affinity_tokens)
        self._tasks: set[asyncio.Task] = set()
        self.decode_pool = EndpointPool("decode", decode, check_interval_s, security=internal_security,
                                        on_change=self._follow_pools)
        self.server = GrpcServer(host, port, public_security)
        self.server.add(generate_pb2_grpc.add_GenerationServicer_to_server, self,
                        generate_pb2.DESCRIPTOR.services_by_name["Generation"])

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
        if self.http_port is not None:
            from router.openai_api import OpenAIAPI, build_app, serve_http

            self._http = await serve_http(build_app(OpenAIAPI(self, self.api_keys)), self.server.host,
                                          self.http_port)

    async def stop(self, grace: float = 1.0) -> None:
        if self._http:
            self._http[0].should_exit = True
            await self._http[1]
        await self.server.stop(grace)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(self.prefill_pool.close(), self.decode_pool.close())

    def health(self) -> dict:
        pools = (self.prefill_pool, self.decode_pool)
        missing = [p.no_healthy_node() for p in pools if not p.healthy()]
        report = {"status": "unavailable" if missing else "ok"}
        if missing:
            report["message"] = "; ".join(missing)
        for p in pools:
            report[p.role] = {"healthy": len(p.healthy()), "nodes": len(p.endpoints)}
        return report

    async def _follow_pools(self) -> None:
        """The gRPC health ("" and the Generation service) says NOT_SERVING while a pool has no
        healthy node; `liveness` stays SERVING (pdserve/grpc_server.py)."""
        serving = self.health()["status"] == "ok"
        if serving != self._serving:
            self._serving = serving
            await self.server.set_serving(serving, ["", GENERATION])

    # ---- a request's life ---------------------------------------------------------------
    async def _serve(self, request: generate_pb2.GenerateRequest,
                     deadline: float = 0.0) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """1. check, 2. place the prefill: remote (next token; KV leased there) or, for a short
        uncached suffix, local on the decode node (router/placement.py), 3. decode (the decode
        node pulls the KV from the prefill node, or computes it itself), 4. stream, with usage and
        timings at the end. If the decode side fails (its node dies, the KV cannot be read or is
        corrupt), the request migrates: a new prefill of prompt + every token streamed so far,
        then a decode elsewhere; the client's stream goes on with no token missing or repeated.
        Raises RequestError; deadline is unix seconds (0: none)."""
        timings = common_pb2.Timings(queued=time.time())
        rid = request.request_id or uuid.uuid4().hex
        # 1. check
        prompt, params = self._check(request)
        sampling = sampling_to_proto(params)
        # n > 1 or beam search: one prefill computes the KV (its own token unused: it must not end
        # the lease, so greedy, no EOS, two tokens), one transfer, and every sample (beam) draws its
        # first token on the decode node, which forks them over the imported blocks
        several = params.forks
        prefill_sampling = sampling_to_proto(SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                            cache_salt=params.cache_salt)) if several else sampling
        salt = params.cache_salt
        generated: list[int] = []  # every token streamed to the client so far
        emitted = 0  # characters of text streamed so far
        for attempt in range(MIGRATIONS + 1):
            tokens = prompt + generated
            began = time.time()
            decode = _pick(self.decode_pool, prompt=tokens, cache_salt=salt)  # cache-aware: where the conversation is
            # 2. place the prefill
            plan, prefill = await self._place(decode, tokens, salt)
            self.metrics.inc("pdserve_prefills_total", where="local" if plan.local else "remote")
            prefill_call = contextlib.nullcontext(False)
            kv = reply = replies = call = None
            if plan.local:  # 2a. the decode node computes the suffix its cache lacks
                prefill, prefill_call = decode, decode.prefill(plan.local_tokens)
            else:  # 2b. remote prefill; layer-wise, its first answer is the KV's descriptor
                prefill, reply, replies, alone = await self._prefill(nodes_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=prefill_sampling, deadline=deadline,
                    output_token_ids=generated, num_emitted_chars=emitted), decode, prefill, plan.remote_tokens)
                kv = reply.kv
            decode_started = False  # once it streams, the decode node has read the KV and released it
            try:
                with decode.track(), self._outstanding(decode):
                    if plan.local:
                        with prefill_call as alone:
                            call = self._decode(decode, rid, attempt, prompt, generated, sampling, None, deadline,
                                                emitted)
                            first = await call.read()  # the first token, from the local prefill
                        if first is grpc.aio.EOF:
                            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None,
                                                       "decode stream ended before the first token")
                        if not timings.first_token:
                            timings.prefill_start, timings.prefill_end = first.prefill_start, first.prefill_end
                            timings.cached_tokens, timings.prefill_node = first.cached_tokens, decode.address
                            timings.local_prefill, timings.first_token = True, time.time()
                        self.placement.measured_local(len(tokens) - first.cached_tokens,
                                                      first.prefill_end - first.prefill_start, alone)
                        parts = _chain(first, call)
                    else:
                        if kv.layerwise:  # 3a. the decode node reads each layer as it is written
                            call = self._decode(decode, rid, attempt, prompt, generated, sampling, kv, deadline,
                                                emitted)
                            reply = await _next_reply(replies)  # the first token
                        if not timings.first_token:
                            timings.prefill_start, timings.prefill_end = reply.prefill_start, reply.prefill_end
                            timings.cached_tokens, timings.prefill_node = reply.cached_tokens, prefill.address
                            timings.first_token = 0 if several else time.time()
                        self._background(self.prefill_pool.refresh(prefill))  # the blocks it just named
                        if several:  # every sample's first token comes from the decode node
                            call = call or self._decode(decode, rid, attempt, prompt, [], sampling, kv, deadline, 0)
                        else:
                            generated.append(reply.first_token_id)
                            emitted += len(reply.text)
                            head = generate_pb2.GenerateResponse(request_id=rid, token_ids=[reply.first_token_id],
                                                                 text=reply.text)
                            if reply.HasField("logprobs"):
                                head.logprobs.append(reply.logprobs)
                            if reply.finished:
                                yield final_message(head, reply.finish_reason, len(prompt), len(generated), timings)
                                return
                            yield head
                            # 3. remote decode on the least busy healthy decode node; it reads the KV itself
                            if call is None:
                                call = self._decode(decode, rid, attempt, prompt, generated, sampling, kv, deadline,
                                                    emitted)
                        parts = call
                    # 4. stream
                    async for part in parts:
                        if not timings.first_token:  # n > 1, beams: the first tokens come from here
                            timings.first_token = time.time()
                        if not decode_started:
                            decode_started = True
                            if not plan.local:
                                timings.transfer_start, timings.transfer_end = part.transfer_start, part.transfer_end
                                timings.decode_admitted, timings.kv_transport = part.decode_admitted, part.kv_transport
                                timings.kv_bytes, timings.decode_cached_tokens = part.kv_bytes, part.cached_tokens
                                self._measured_remote(tokens, reply, part, began, alone)
                        generated.extend(part.token_ids)
                        emitted += len(part.text)
                        msg = generate_pb2.GenerateResponse(request_id=rid, token_ids=part.token_ids, text=part.text,
                                                            logprobs=part.logprobs, index=part.index,
                                                            finish_reason=part.finish_reason)
                        if part.finished:
                            yield final_message(msg, part.finish_reason, len(prompt), len(generated), timings)
                            return
                        yield msg
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "decode stream ended early")
            except PrefillFailed as e:  # layer-wise, after the descriptor: nothing streamed yet
                if e.code != grpc.StatusCode.UNAVAILABLE or attempt == MIGRATIONS:
                    raise RequestError(e.code, f"prefill: {e.details}") from None
                log.warning("request %s: prefill on %s failed (%s); retrying", rid, prefill.address, e.details)
                prefill.healthy = False  # until a health check passes again
            except grpc.aio.AioRpcError as e:
                # n > 1 and beams do not migrate once tokens streamed: they forked on the node that died
                if several and generated and e.code() in MIGRATE_ON:
                    raise RequestError(e.code(), f"decode node {decode.address} failed after the samples began "
                                       f"({e.details()}); requests with n, best_of or beam_width > 1 do not "
                                       "migrate (every sample forked there): retry the request") from None
                if e.code() not in MIGRATE_ON or attempt == MIGRATIONS or (deadline and time.time() >= deadline):
                    raise RequestError(e.code(), f"decode: {e.details()}") from None
                log.warning("request %s: decode on %s failed (%s: %s) after %d tokens; migrating", rid,
                            decode.address, e.code().name, e.details(), len(generated))
                self.metrics.inc("pdserve_migrations_total")
                await self.decode_pool.check(decode)  # a dead node leaves the pool now
            finally:
                if decode_started:
                    self._background(self.decode_pool.refresh(decode))  # what its cache holds now
                for c in (call, replies):
                    if c is not None and not c.done():
                        c.cancel()  # a cancelled client, or a deadline: the nodes stop and free
                if kv is not None and not decode_started and kv.lease_id and not reply.finished:
                    # nobody read the KV: free it on the prefill node now (a finished prefill did)
                    await asyncio.shield(self._release_kv(prefill, kv.lease_id))

    async def _place(self, decode, tokens: list[int], salt: str):
        """Where this request's prefill runs (router/placement.py), and the prefill node that
        would run it remotely (None: no healthy one; then the decode node does, if it may)."""
        try:
            prefill = self.prefill_pool.pick(prompt=tokens, cache_salt=salt)
        except NoHealthyNode:
            prefill = None
        if self.placement.mode == "auto":
            await self.decode_pool.settled(decode)
        decode_cached = self.decode_pool.cached_tokens(decode, tokens, salt)
        prefill_cached = self.prefill_pool.cached_tokens(prefill, tokens, salt) if prefill else 0
        # the decode node reads only the blocks it lacks (shm with generation counters, tcp), when
        # both sides' blocks are of one size
        partial = decode.load.kv_transport != "grpc" and prefill is not None and \
            prefill.load.block_size == decode.load.block_size
        plan = self.placement.decide(len(tokens), decode_cached, prefill_cached,
                                     moved=len(tokens) - (decode_cached if partial else 0),
                                     prefill_queued=prefill.prefill_tokens if prefill else 0,
                                     local_queued=decode.prefill_tokens, decode_running=decode.outstanding)
        if prefill is None and self.placement.mode != "off":
            plan.local = True
        log.debug("placement: %s (decode node caches %d of %d tokens, %d decoding there)", plan, decode_cached,
                  len(tokens), decode.outstanding)
        return plan, prefill

    def _measured_remote(self, tokens, reply, part, began: float, alone: bool) -> None:
        prefill_s = reply.prefill_end - reply.prefill_start
        transfer_s = part.transfer_end - part.transfer_start
        handoff_s = part.decode_admitted - began - prefill_s - transfer_s  # hops, queues, admission
        self.placement.measured_remote(len(tokens) - reply.cached_tokens, prefill_s, transfer_s,
                                       moved=len(tokens) - part.cached_tokens, handoff_s=handoff_s, alone=alone)

    def _background(self, task: asyncio.Task) -> None:
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    # ---- steps ------------------------------------------------------------------------------
    async def _prefill(self, request: nodes_pb2.PrefillRequest, decode, prefill, num_tokens: int):
        """Returns (prefill node, its first answer, the rest of a layer-wise answer or None, whether
        it ran alone there). prefill: the node to try first (None: pick one, cache-aware);
        num_tokens: what it computes. Prefill has no effect but a lease that expires, so a node that
        cannot be reached (gone, restarting) is retried on another; other errors are the request's."""
        tried: set[str] = set()
        tokens = list(request.prompt_token_ids) + list(request.output_token_ids)
        while True:
            if prefill is None:
                prefill = _pick(self.prefill_pool, tried, tokens, request.sampling.cache_salt)  # cache-aware
            try:
                with prefill.track(), self._outstanding(prefill), prefill.prefill(num_tokens) as alone:
                    if not self._layerwise(prefill, decode):
                        reply = await prefill.stub.Prefill(request, timeout=remaining(request.deadline))
                        return prefill, reply, None, alone
                    replies = prefill.stub.StreamPrefill(request, timeout=remaining(request.deadline))
                    return prefill, await _next_reply(replies, raw=True), replies, alone
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or len(tried) + 1 >= PREFILL_ATTEMPTS:
                    raise RequestError(e.code(), f"prefill: {e.details()}") from None
                log.warning("prefill node %s unreachable (%s); retrying elsewhere", prefill.address, e.details())
                prefill.healthy = False  # until a health check passes again
                tried.add(prefill.address)
                prefill = None

    def _layerwise(self, prefill, decode) -> bool:
        """Whether to stream the KV layer by layer: where the prefill node can and the decode node
        reads over tcp. auto: across hosts (on one host shared memory moves the whole KV in a few
        milliseconds) or where the decode node is told to use tcp."""
        if self.kv_layerwise == "off" or not prefill.load.kv_layerwise or decode.load.kv_transport not in ("auto", "tcp"):
            return False
        return (self.kv_layerwise == "on" or decode.load.kv_transport == "tcp"
                or prefill.load.host_id != decode.load.host_id)

    @staticmethod
    def _decode(decode, rid, attempt, prompt, generated, sampling, kv, deadline, emitted):
        """The Decode call; kv None: the decode node prefills locally."""
        return decode.stub.Decode(nodes_pb2.DecodeRequest(
            request_id=f"{rid}#{attempt}", prompt_token_ids=prompt, output_token_ids=generated, sampling=sampling,
            kv=kv, deadline=deadline, num_emitted_chars=emitted, prefill_locally=kv is None),
            timeout=remaining(deadline))

    @contextlib.contextmanager
    def _outstanding(self, endpoint):
        role = "prefill" if endpoint in self.prefill_pool.endpoints else "decode"
        self.metrics.set("pdserve_node_outstanding_requests", endpoint.outstanding, role=role, node=endpoint.address)
        try:
            yield
        finally:
            self.metrics.set("pdserve_node_outstanding_requests", endpoint.outstanding - 1, role=role,
                             node=endpoint.address)

    @staticmethod
    async def _release_kv(prefill, lease_id: str) -> None:
        try:
            await nodes_pb2_grpc.KVPlaneStub(prefill.channel).ReleaseKV(
                nodes_pb2.ReleaseKVRequest(lease_id=lease_id), timeout=5)
        except grpc.aio.AioRpcError as e:  # the lease expires on its own
            log.warning("ReleaseKV %s on %s failed: %s", lease_id, prefill.address, e.code().name)


class PrefillFailed(Exception):
    """A layer-wise prefill failed after it had described its KV."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


async def _next_reply(replies, raw: bool = False) -> nodes_pb2.PrefillResponse:
    """The next message of a StreamPrefill call. raw: its errors as they are (before the
    descriptor, when the prefill may still be retried elsewhere), else as PrefillFailed."""
    try:
        reply = await replies.read()
    except grpc.aio.AioRpcError as e:
        if raw:
            raise
        raise PrefillFailed(e.code(), e.details()) from None
    if reply is grpc.aio.EOF:
        if raw:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "prefill stream ended early")
        raise PrefillFailed(grpc.StatusCode.UNAVAILABLE, "prefill stream ended before the first token")
    return reply


async def _chain(first, call):
    """The first message already read from a Decode call, then the rest of it."""
    yield first
    while (part := await call.read()) is not grpc.aio.EOF:
        yield part


def _pick(pool: EndpointPool, exclude: set[str] = frozenset(), prompt: list[int] | None = None,
          cache_salt: str = ""):
    try:
        return pool.pick(exclude, prompt, cache_salt)
    except NoHealthyNode as e:
        raise RequestError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
