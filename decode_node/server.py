"""The decode node: pulls each sequence's KV from its prefill node, then decodes it in the
continuous batch and streams the tokens. A request the router sends with prefill_locally (a
short uncached suffix, router/placement.py) is prefilled here instead, from this node's prefix cache.

Lifecycle of a request here:
  1. prealloc - blocks reserved for the prompt's KV (waits while the pool is full)
  2. transfer - the KV is read from the prefill node straight into those blocks (shared memory
                on one host, the raw TCP data plane otherwise), digest-checked; the prefill node is told
                it may free its copy. A layer-wise source is read while its prefill still computes,
                and the first token arrives with its last layer
  3. running  - the sequence joins the decode batch between two steps
  4. finished - EOS, stop, length, or cancelled: its blocks are freed
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import grpc

from engine import EngineConfig, LLMEngine
from engine.async_engine import AsyncEngine
from kvtransfer.base import KVCorrupt, KVTransferError
from kvtransfer.layout import KVLayout, KVLayoutMismatch, model_fingerprint
from kvtransfer.receiver import KVReceiver
from kvtransfer.shm import host_id
from pdserve.grpc_server import GrpcServer
from pdserve.metrics import EngineExporter, Metrics
from pdserve.protocol import logprobs_to_proto, sampling_from_proto
from pdserve.security import NONE, Security
from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc

log = logging.getLogger(__name__)
BLOCK_WAIT_S = 30.0  # how long a request may wait for free blocks without a deadline


class DecodeNode(nodes_pb2_grpc.DecodeNodeServicer):
    def __init__(self, config: EngineConfig, host: str = "127.0.0.1", port: int = 0, kv_transport: str = "auto",
                 metrics: Metrics | None = None, security: Security = NONE, max_queued: int = 512,
                 kv_tcp_connections: int = 1):
        engine = LLMEngine(config)
        self.engine = AsyncEngine(engine)
        self.layout = KVLayout.of(engine.kv_cache, model_fingerprint(engine.model_dir))
        self.receiver = KVReceiver(engine.kv_cache, self.layout, kv_transport, security, kv_tcp_connections)
        self.max_queued = max_queued  # streams waiting for blocks or KV; beyond, RESOURCE_EXHAUSTED
        # Fault injection for chaos tests: a pause before each transfer (PDSERVE_FAULT_DELAY_TRANSFER_S).
        self.fault_delay_transfer_s = float(os.environ.get("PDSERVE_FAULT_DELAY_TRANSFER_S", "0"))
        self._tasks: set[asyncio.Task] = set()
        self.num_active = 0  # Decode streams open: transferring or decoding
        self.metrics = metrics or Metrics()
        self.exporter = EngineExporter(self.metrics, "decode", self.engine, lambda: self.num_active)
        self._export: asyncio.Task | None = None
        self.server = GrpcServer(host, port, security)
        self.server.add(nodes_pb2_grpc.add_DecodeNodeServicer_to_server, self,
                        nodes_pb2.DESCRIPTOR.services_by_name["DecodeNode"])

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        await self.server.start()
        self._export = asyncio.create_task(self.exporter.run())

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        if self._export:
            self._export.cancel()
        await self.receiver.close()
        self.engine.stop()

    async def Decode(self, request: nodes_pb2.DecodeRequest, context):
        capacity = self.max_queued + self.engine.engine.config.max_num_seqs
        if self.num_active >= capacity:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode node at capacity ({self.num_active} streams open)")
        self.num_active += 1
        try:
            async for msg in self._decode(request, context):
                yield msg
        finally:
            self.num_active -= 1

    async def drain(self, timeout_s: float, min_s: float = 2.0) -> None:
        """Stops taking work (health NOT_SERVING) and lets every open stream finish, at most
        timeout_s (a scale-down loses no tokens); and waits at least min_s, so that routers see
        the node go before it stops answering."""
        await self.server.set_serving(False)
        started = time.time()
        while self.num_active and time.time() < started + timeout_s or time.time() < started + min_s:
            await asyncio.sleep(0.05)

    async def _decode(self, request: nodes_pb2.DecodeRequest, context):
        engine = self.engine.engine
        source = request.kv
        try:
            params = sampling_from_proto(request.sampling)
            if request.prefill_locally and source.lease_id:
                raise ValueError("a request prefilled locally carries no kv source")
            # n > 1: every sample draws its first token here, from the one imported KV
            several = params.forks
            if several and request.output_token_ids:
                raise ValueError("output_token_ids must be empty with n, best_of or beam_width > 1: each sample "
                                 "draws its first token on the decode node")
            if not (request.prefill_locally or request.output_token_ids or source.layerwise or several):
                raise ValueError("output_token_ids must hold the token sampled by the prefill")  # layer-wise: with the KV
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.prefill_locally:
            async for msg in self._prefill_here(request, params, context):
                yield msg
            return
        output_token_ids, num_emitted_chars = list(request.output_token_ids), request.num_emitted_chars
        # 1. prealloc: where the transport can leave blocks out, the prompt's cached prefix is taken
        #    from this node's prefix cache (a conversation's earlier turns) and only the rest is read
        try:
            partial = (engine.config.enable_prefix_caching and source.layout.block_size == engine.config.block_size
                       and self.receiver.can_skip(source))
        except KVTransferError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        kv_tokens = (list(request.prompt_token_ids) + output_token_ids)[:source.num_tokens] if partial else None
        blocks, skip = await self._reserve(source.num_tokens, request.deadline, context, kv_tokens, params.cache_salt)
        owned = True  # until add_prefilled_request takes the blocks over
        transfer = None
        try:
            # 2. transfer
            if self.fault_delay_transfer_s:
                await asyncio.sleep(self.fault_delay_transfer_s)
            try:
                transfer = self.receiver.start(source, blocks, skip)
                await transfer.wait()
            except KVLayoutMismatch as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except KVCorrupt as e:
                await context.abort(grpc.StatusCode.DATA_LOSS, str(e))
            except KVTransferError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            if transfer.outcome is not None and not several:  # layer-wise: the prefill's first token
                if transfer.outcome["finished"]:  # nothing to decode; the prefill node ended the lease
                    yield nodes_pb2.DecodeResponse(finished=True, finish_reason=transfer.outcome["finish_reason"])
                    return
                output_token_ids.append(transfer.outcome["token_id"])
                num_emitted_chars += transfer.outcome["text_chars"]
            self._background(self._confirm_read(source))
            seconds = transfer.seconds
            self.metrics.observe("pdserve_kv_transfer_seconds", seconds, transport=transfer.transport)
            self.metrics.observe("pdserve_kv_transfer_bytes", transfer.num_bytes, transport=transfer.transport)
            if seconds > 0:
                self.metrics.set("pdserve_kv_transfer_gbps", transfer.num_bytes / seconds / 1e9,
                                 transport=transfer.transport)

            # 3. running: from the moment the admission is queued, the engine owns the blocks (it
            #    frees them if the admission fails or the request is aborted)
            admitted = []

            def admit():  # in the engine thread, between two steps: the next step decodes it
                admitted.append(time.time())
                engine.add_prefilled_request(request.request_id, list(request.prompt_token_ids),
                                             output_token_ids, params, blocks, num_emitted_chars=num_emitted_chars)

            first = True
            owned = False  # no await between this and the admission being queued
            async for out in self.engine.stream(request.request_id, admit):
                msg = _response(out)
                if first:
                    msg.transfer_start, msg.transfer_end = transfer.started, transfer.ended
                    msg.decode_admitted, msg.kv_transport, msg.kv_bytes = admitted[0], transfer.transport, transfer.num_bytes
                    msg.cached_tokens = transfer.skipped_tokens
                    first = False
                yield msg
        except ValueError as e:  # refused at admission (e.g. the request id is in use)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            if owned:  # 4. (never admitted) the reserved blocks go back, once nothing writes them;
                #          one shielded task, so that a cancellation cannot stop it half-way
                await asyncio.shield(self._give_back(transfer, blocks))

    async def _prefill_here(self, request: nodes_pb2.DecodeRequest, params, context):
        """Conditional disaggregation: the prompt's KV computed here, in the continuous batch
        (a mixed step), from the longest prefix this node's cache holds; then decoding goes on."""
        engine = self.engine.engine
        prior = list(request.output_token_ids)  # a migrated request's tokens so far: recomputed
        start = time.time()
        first = True
        try:
            async for out in self.engine.stream(request.request_id, lambda: engine.add_request(
                    request.request_id, list(request.prompt_token_ids), params, output_token_ids=prior,
                    num_emitted_chars=request.num_emitted_chars if prior else None)):
                msg = _response(out)
                if first:
                    msg.prefill_start, msg.prefill_end = start, time.time()
                    msg.decode_admitted, msg.cached_tokens = start, out.num_cached_tokens
                    first = False
                yield msg
        except ValueError as e:  # refused at admission: names what is wrong
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _give_back(self, transfer, blocks: list[int]) -> None:
        if transfer is not None:
            await transfer.settle()
        await self.engine.call(self.engine.engine.free_kv, blocks)

    def _background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    async def _reserve(self, num_tokens: int, deadline: float, context,
                       kv_tokens: list[int] | None = None, cache_salt: str = "") -> tuple[list[int], int]:
        """Blocks for num_tokens of KV, and how many leading ones the prefix cache filled (with
        kv_tokens, the tokens of that KV, they are looked up)."""
        engine = self.engine.engine
        give_up = deadline or time.time() + BLOCK_WAIT_S
        while True:
            try:
                reserved = await self.engine.call_or_undo(lambda: self._try_reserve(num_tokens, kv_tokens, cache_salt),
                                                          lambda r: self.engine.engine.free_kv(r[0]))
            except ValueError as e:  # longer than this node can ever hold
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if reserved is not None:
                return reserved
            if time.time() >= give_up:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"decode node out of KV blocks for {num_tokens} tokens "
                                    f"({engine.block_manager.num_free_blocks} free)")
            await asyncio.sleep(0.01)

    def _try_reserve(self, num_tokens: int, kv_tokens: list[int] | None,
                     cache_salt: str) -> tuple[list[int], int] | None:
        engine = self.engine.engine
        if kv_tokens is not None and len(kv_tokens) == num_tokens:
            return engine.reserve_kv_cached(kv_tokens, cache_salt)
        return (engine.reserve_kv(num_tokens), 0) if engine.can_reserve_kv(num_tokens) else None

    async def _confirm_read(self, source: nodes_pb2.KVSource) -> None:
        """Tells the prefill node it may free its copy of the KV."""
        try:
            stub = nodes_pb2_grpc.KVPlaneStub(self.receiver.grpc.channel(source.kv_address))
            await stub.ReleaseKV(nodes_pb2.ReleaseKVRequest(lease_id=source.lease_id), timeout=5)
        except grpc.aio.AioRpcError as e:  # the lease will expire on its own
            log.warning("ReleaseKV of %s at %s failed: %s", source.lease_id, source.kv_address, e.code().name)

    async def GetLoad(self, request, context) -> common_pb2.NodeLoad:
        # plain counters read now, not between two steps: a long step must not look like a dead node
        engine = self.engine.engine
        return common_pb2.NodeLoad(**engine.load(), host_id=host_id(), kv_transport=self.receiver.transport,
                                   block_size=engine.config.block_size,
                                   **engine.block_manager.cache_changes(request.cache_since))


def _response(out) -> nodes_pb2.DecodeResponse:
    """One engine output as a Decode stream message."""
    msg = nodes_pb2.DecodeResponse(token_ids=out.new_token_ids, text=out.new_text, finished=out.last,
                                   finish_reason=out.finish_reason or "", index=out.index)
    if out.logprobs:  # one entry per new token (several after a verified draft)
        msg.logprobs.extend(logprobs_to_proto(lp) for lp in out.logprobs[-len(out.new_token_ids):])
    return msg
