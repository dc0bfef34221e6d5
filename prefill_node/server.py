"""The prefill node: computes prompts' KV and first tokens, and serves the KV to decode nodes.

Lifecycle of a request here:
  1. waiting  - queued in the engine; all prompts waiting at a step go into one packed forward
  (layer-wise, StreamPrefill: once its last chunk is scheduled the kv_lease begins and its
  descriptor goes out; a decode node reads each layer over tcp as soon as it is written)
  2. prefilled - first token sampled; the prompt's KV stays in its blocks under a kv_lease
  3. read     - a decode node reads the KV (shared memory on one host, raw TCP, or a gRPC stream)
  4. released - the decode node confirms (ReleaseKV), or the lease expires: blocks freed
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

import grpc

from engine import EngineConfig, LLMEngine
from engine.async_engine import AsyncEngine
from engine.hardware import resolve_device
from engine.kv_progress import LayerProgress
from kvtransfer.grpc_stream import KVPlaneServicer
from kvtransfer.layout import KVLayout, kv_digest, model_fingerprint
from kvtransfer.lease import LeaseTable
from kvtransfer.shm import SharedKVRegion, host_id
from kvtransfer.tcp import TcpKVServer
from pdserve.grpc_server import GrpcServer
from pdserve.metrics import EngineExporter, Metrics
from pdserve.protocol import logprobs_to_proto, sampling_from_proto
from pdserve.security import NONE, Security
from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc

log = logging.getLogger(__name__)


class PrefillNode(nodes_pb2_grpc.PrefillNodeServicer):
    def __init__(self, config: EngineConfig, host: str = "127.0.0.1", port: int = 0, lease_ttl_s: float = 30.0,
                 shm: bool = True, metrics: Metrics | None = None, security: Security = NONE,
                 max_pending: int = 512, kv_tcp_port: int = 0):
        self.region: SharedKVRegion | None = None

        def allocator(nbytes: int):  # register: the whole KV tensor lives in a /dev/shm region
            self.region = SharedKVRegion(nbytes)
            return self.region.tensor

        # A KV cache on a GPU is not in host shared memory; decode nodes pull it over gRPC.
        use_shm = shm and resolve_device(config.device).type == "cpu"
        engine = LLMEngine(config, kv_allocator=allocator if use_shm else None)
        if self.region is not None:
            self.region.add_generations(engine.kv_cache.num_blocks)
        self.engine = AsyncEngine(engine)
        self.layout = KVLayout.of(engine.kv_cache, model_fingerprint(engine.model_dir))
        self.leases = LeaseTable(lease_ttl_s)
        self.host_id = host_id()
        self.server = GrpcServer(host, port, security)
        self.max_pending = max_pending  # admission control: beyond, RESOURCE_EXHAUSTED at once
        self.server.add(nodes_pb2_grpc.add_PrefillNodeServicer_to_server, self,
                        nodes_pb2.DESCRIPTOR.services_by_name["PrefillNode"])
        self.kv_plane = KVPlaneServicer(engine.kv_cache, self.layout, self.leases, self.release)
        self.server.add(nodes_pb2_grpc.add_KVPlaneServicer_to_server, self.kv_plane,
                        nodes_pb2.DESCRIPTOR.services_by_name["KVPlane"])
        # The raw TCP data plane: decode nodes on other hosts read the leased blocks from it.
        self.kv_tcp = TcpKVServer(engine.kv_cache, self.layout, self.leases, host, kv_tcp_port, security)
        # Layer-wise streaming (StreamPrefill) sends layers from host memory as they are written.
        self.layerwise = engine.kv_cache.kv.device.type == "cpu"
        self._expiry: asyncio.Task | None = None
        self.metrics = metrics or Metrics()
        self.exporter = EngineExporter(self.metrics, "prefill", self.engine, lambda: self.num_pending)
        self._export: asyncio.Task | None = None
        self.num_pending = 0  # Prefill calls received and not yet answered
        self.pending_tokens = 0  # their prompt tokens: the prefill pool's autoscaling signal
        self.num_prefilled = 0

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        await self.server.start()
        self.kv_tcp.start()
        self._expiry = asyncio.create_task(self._expire_leases())
        self._export = asyncio.create_task(self.exporter.run())

    async def drain(self, timeout_s: float, min_s: float = 2.0) -> None:
        """Stops taking work (health NOT_SERVING) and waits until every prefill is answered and
        every lease is read or expired, at most timeout_s; and at least min_s, so that routers
        see the node go before it stops answering."""
        await self.server.set_serving(False)
        started = time.time()
        while ((self.num_pending or len(self.leases)) and time.time() < started + timeout_s
               or time.time() < started + min_s):
            await asyncio.sleep(0.05)

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        self.kv_tcp.stop()
        for task in (self._expiry, self._export):
            if task:
                task.cancel()
        self.engine.stop()
        if self.region is not None:
            self.region.close()

    # ---- PrefillNode service --------------------------------------------------------------
    async def Prefill(self, request: nodes_pb2.PrefillRequest, context) -> nodes_pb2.PrefillResponse:
        response = None
        async for response in self._admit(request, context, layerwise=False):  # one answer
            pass
        return response

    async def StreamPrefill(self, request: nodes_pb2.PrefillRequest, context):
        if not self.layerwise:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this prefill node cannot stream KV layer by layer (its KV is not in host memory)")
        async for response in self._admit(request, context, layerwise=True):
            yield response

    async def _admit(self, request: nodes_pb2.PrefillRequest, context, layerwise: bool):
        if request.deadline and request.deadline < time.time():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before prefill")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = list(request.prompt_token_ids)
        if self.num_pending >= self.max_pending:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"prefill node at capacity ({self.num_pending} prefills pending)")
        self.num_pending += 1
        self.pending_tokens += len(prompt)
        try:
            async for response in self._prefill(request, params, prompt, context, layerwise):
                yield response
        finally:
            self.num_pending -= 1
            self.pending_tokens -= len(prompt)
            self.num_prefilled += 1

    async def _prefill(self, request, params, prompt: list[int], context, layerwise: bool):
        """Yields the answer; layer-wise, first the KV's descriptor as soon as the prompt's last
        chunk is scheduled (its blocks are fixed then), while the layers still compute."""
        engine = self.engine.engine
        # Internal id: a retried request id must not collide with a lease still held.
        rid = f"{request.request_id}#{uuid.uuid4().hex[:8]}"
        prior = list(request.output_token_ids)  # a migrated request's tokens so far
        once = dataclasses.replace(params, max_tokens=len(prior) + 1)
        # The first token is the request's last (max_tokens): no KV is handed on, and its text is
        # final here (an incomplete character flushed as the engine alone does, not held back)
        last = params.max_tokens <= len(prior) + 1
        progress = LayerProgress(self.layout.num_layers) if layerwise and not last else None
        scheduled = _signal(progress)
        start = time.time()
        compute = asyncio.ensure_future(self._compute(rid, prompt, once, prior, request, progress, keep_kv=not last))
        lease = None
        kept = False  # the lease outlives this call: a decode node reads (or will read) it
        try:
            if progress is not None:
                await asyncio.wait([scheduled, compute], return_when=asyncio.FIRST_COMPLETED)
                if scheduled.done():
                    lease = self.leases.add(rid, progress.block_table, progress.num_tokens, 0, progress)
                    yield nodes_pb2.PrefillResponse(kv=self._source(lease, layerwise=True))
            try:
                out = await compute
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            end = time.time()
            self.metrics.observe("pdserve_prefill_compute_seconds", end - start)
            response = nodes_pb2.PrefillResponse(first_token_id=out.token_ids[-1], text=out.new_text,
                                                 finished=False, prefill_start=start, prefill_end=end,
                                                 cached_tokens=out.num_cached_tokens)
            if out.logprobs:
                response.logprobs.CopyFrom(logprobs_to_proto(out.logprobs[-1]))
            total = len(prompt) + len(out.token_ids)
            if out.finish_reason == "stop" or params.max_tokens <= len(out.token_ids) or total >= engine.max_model_len:
                response.finished = True
                response.finish_reason = "stop" if out.finish_reason == "stop" else "length"
                if progress is not None:  # the decode node's read ends with this trailer
                    progress.finish({"finished": True, "finish_reason": response.finish_reason})
            elif lease is not None:  # layer-wise: the decode node gets the token in the trailer
                self.leases.start_clock(lease)
                progress.finish({"finished": False, "token_id": response.first_token_id,
                                 "text_chars": len(response.text)})
                kept = True
            else:
                lease = await self._lease(rid)
                response.kv.CopyFrom(self._source(lease, layerwise=False))
                kept = True
            yield response
        finally:
            if not compute.done():
                compute.cancel()  # aborts the engine request: its blocks are freed
            if not kept:
                if progress is not None:
                    progress.fail("prefill ended without a first token to decode from")
                if lease is not None and self.leases.pop(lease.lease_id) is not None:
                    await asyncio.shield(self._end(lease))
                else:
                    await asyncio.shield(self.engine.call(engine.release_kv, rid))

    async def _compute(self, rid: str, prompt: list[int], once, prior: list[int], request, progress, keep_kv: bool):
        engine = self.engine.engine
        out = None
        async for out in self.engine.stream(rid, lambda: engine.add_request(
                rid, prompt, once, keep_kv=keep_kv, output_token_ids=prior,
                num_emitted_chars=request.num_emitted_chars if prior else None, kv_progress=progress)):
            pass
        return out

    async def _lease(self, rid: str):
        engine = self.engine.engine
        held = await self.engine.call(lambda: engine.kv_leases[rid])
        digest = await asyncio.to_thread(kv_digest, engine.kv_cache.kv, held.block_table, held.num_tokens)
        return self.leases.add(rid, held.block_table, held.num_tokens, digest)

    def _source(self, lease, layerwise: bool) -> nodes_pb2.KVSource:
        """The descriptor a decode node reads the lease with. A layer-wise lease is readable over
        tcp only, each layer with its own digest (the whole-KV digest is not known yet)."""
        source = nodes_pb2.KVSource(
            lease_id=lease.lease_id, kv_address=self.address, host_id=self.host_id, layout=self.layout.to_proto(),
            block_ids=lease.block_ids, num_tokens=lease.num_tokens, digest=lease.digest,
            num_bytes=self.layout.num_bytes(lease.num_tokens), lease_expires=min(lease.expires_at, 1e12),
            tcp_address=self.kv_tcp.address, access_key=lease.access_key, layerwise=layerwise)
        if self.region is not None and not layerwise:
            source.shm_region, source.region_bytes = self.region.name, self.region.nbytes
            source.block_generations.extend(self.region.generations[lease.block_ids].tolist())
        return source

    async def release(self, lease_id: str) -> bool:
        """Ends a kv_lease (the decode side confirmed its read, or gave up): frees its blocks."""
        lease = self.leases.pop(lease_id)
        if lease is None:
            return False
        await self._end(lease)
        return True

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.leases.ttl_s / 4))
            for lease in self.leases.pop_expired():
                log.warning("kv_lease %s of %s expired unread; freeing %d blocks", lease.lease_id,
                            lease.request_id, len(lease.block_ids))
                await self._end(lease)

    async def _end(self, lease) -> None:
        """The blocks' generations move on before the blocks can be reused (see kvtransfer/shm.py)."""
        if self.region is not None:
            self.region.end_lease(lease.block_ids)
        await self.engine.call(self.engine.engine.release_kv, lease.request_id)

    async def GetLoad(self, request, context) -> common_pb2.NodeLoad:
        # plain counters read now, not between two steps: a long step must not look like a dead node
        engine = self.engine.engine
        return common_pb2.NodeLoad(**engine.load(), host_id=self.host_id, kv_layerwise=self.layerwise,
                                   block_size=engine.config.block_size,
                                   **engine.block_manager.cache_changes(request.cache_since))


def _signal(progress: LayerProgress | None) -> asyncio.Future | None:
    """A future set (on this loop) when the engine thread has scheduled the prompt's last chunk."""
    if progress is None:
        return None
    loop = asyncio.get_running_loop()
    scheduled = loop.create_future()

    def on_scheduled():
        loop.call_soon_threadsafe(lambda: scheduled.done() or scheduled.set_result(None))

    progress.on_scheduled = on_scheduled
    return scheduled
