"""The prefill node: computes prompts' KV and first tokens, and serves the KV to decode nodes.

Lifecycle of a request here:
  1. admitted  - checked and counted (admission control), queued in the engine: all prompts
                 waiting at a step go into one packed forward
  2. scheduled - layer-wise (StreamPrefill) only: its last chunk is in a step, so its blocks are
                 fixed; the kv_lease begins and its descriptor goes out while the layers compute
  3. prefilled - its next token sampled (LLMEngine.add_prefill). The request ends here (stop,
                 length), or its KV stays in its blocks under the kv_lease and the descriptor goes
                 out (layer-wise, the first token goes with the KV's last layer)
  4. read      - a decode node reads the KV over a transport (kvtransfer/)
  5. released  - the decode node confirms (ReleaseKV), or the lease expires: its blocks are freed
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from engine import EngineConfig, LLMEngine
from engine.hardware import resolve_device
from engine.kv_progress import LayerProgress
from kvtransfer.base import SenderContext
from kvtransfer.layout import KVLayout, kv_digest, model_fingerprint
from kvtransfer.lease import Lease, LeaseTable
from kvtransfer.security import NONE, Security
from kvtransfer.sender import KVSenders
from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc
from prefill_node.config import PrefillConfig
from serving.metrics import Metrics
from serving.node import EngineServer
from serving.protocol import logprobs_to_proto, sampling_from_proto

log = logging.getLogger(__name__)


class PrefillNode(EngineServer, nodes_pb2_grpc.PrefillNodeServicer):
    role = "prefill"

    def __init__(
        self,
        engine_config: EngineConfig,
        config: PrefillConfig = PrefillConfig(),
        *,
        host: str = "127.0.0.1",
        metrics: Metrics | None = None,
        security: Security = NONE,
        kv_options: tuple = (),
        any_port_if_taken: bool = False,
    ):
        """kv_options: the KV transports' sender options (kvtransfer/transports.py)."""
        self.config = config
        self.senders = KVSenders(kv_options)  # 1. register: a transport may want the KV tensor in its memory
        llm = LLMEngine(engine_config, kv_allocator=self.senders.allocator(resolve_device(engine_config.device)))
        super().__init__(llm, host, config.port, security, metrics, any_port_if_taken)
        self.server.add(
            nodes_pb2_grpc.add_PrefillNodeServicer_to_server, self, nodes_pb2.DESCRIPTOR.services_by_name["PrefillNode"]
        )
        self.layout = KVLayout.of(
            llm.kv_cache, model_fingerprint(llm.model_dir), llm.numerics, llm.model_config.attention
        )
        self.leases = LeaseTable(config.lease_ttl_s)
        self.senders.attach(
            SenderContext(
                llm.kv_cache, llm.block_manager, self.layout, self.leases, host, security, self.server, self.release
            )
        )
        self.num_pending = 0  # Prefill calls received and not yet answered
        self.pending_tokens = 0  # their prompt tokens: the prefill pool's autoscaling signal
        self.num_prefilled = 0

    def num_open(self) -> int:
        return self.num_pending

    def busy(self) -> bool:
        return bool(self.num_pending or len(self.leases))

    async def start(self) -> None:
        await super().start()
        await self.senders.start()
        self.background(self._expire_leases())

    async def stop(self, grace: float = 1.0) -> None:
        await super().stop(grace)
        await self.senders.stop()

    # ---- PrefillNode service --------------------------------------------------------------
    async def Prefill(self, request: nodes_pb2.PrefillRequest, context) -> nodes_pb2.PrefillResponse:
        answers = [response async for response in self._admit(request, context, layerwise=False)]
        return answers[-1]  # the only one

    async def StreamPrefill(self, request: nodes_pb2.PrefillRequest, context):
        if not any(c.layerwise for c in self.senders.capabilities()):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this prefill node cannot stream KV layer by layer (its KV is not in host memory)",
            )
        async for response in self._admit(request, context, layerwise=True):
            yield response

    async def ReleaseKV(self, request: nodes_pb2.ReleaseKVRequest, context) -> nodes_pb2.ReleaseKVResponse:
        return nodes_pb2.ReleaseKVResponse(released=await self.release(request.lease_id, request.access_key))

    async def GetLoad(self, request, context) -> common_pb2.NodeLoad:
        return common_pb2.NodeLoad(
            **self.llm.load(),
            **self.llm.cache_changes(request.cache_since),
            host_id=self.senders.host_id,
            kv_transports=[c.to_proto() for c in self.senders.capabilities()],
        )

    # ---- a request's life -------------------------------------------------------------------
    async def _admit(self, request: nodes_pb2.PrefillRequest, context, layerwise: bool):
        """1. admitted: checked, then counted while it is in flight."""
        if request.deadline and request.deadline < time.time():
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before prefill")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.num_pending >= self.config.max_pending:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"prefill node at capacity ({self.num_pending} prefills pending)"
            )
        num_tokens = len(request.prompt_token_ids)
        self.num_pending += 1
        self.pending_tokens += num_tokens
        try:
            async for response in self._prefill(request, params, context, layerwise):
                yield response
        finally:
            self.num_pending -= 1
            self.pending_tokens -= num_tokens
            self.num_prefilled += 1

    async def _prefill(self, request: nodes_pb2.PrefillRequest, params, context, layerwise: bool):
        """2.-3. Yields the answer; layer-wise, first the KV's descriptor as soon as the prompt's
        last chunk is scheduled (its blocks are fixed then), while the layers still compute."""
        rid = f"{request.request_id}#{uuid.uuid4().hex[:8]}"  # a retried id must not collide with a lease held
        progress = LayerProgress(self.layout.num_layers) if layerwise else None
        scheduled = _signal(progress)
        start = time.time()
        compute = asyncio.ensure_future(self._compute(rid, request, params, progress))
        lease, kept = None, False  # kept: the lease outlives this call (a decode node reads it)
        try:
            if progress is not None:  # 2. scheduled
                await asyncio.wait([scheduled, compute], return_when=asyncio.FIRST_COMPLETED)
                if scheduled.done():
                    lease = self.leases.add(rid, progress.block_table, progress.num_tokens, 0, progress)
                    yield nodes_pb2.PrefillResponse(kv=self.senders.describe(lease, layerwise=True))
            try:
                out = await compute  # 3. prefilled
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            response = _first_token(out, start)
            self.metrics.observe("pdserve_prefill_compute_seconds", response.prefill_end - start)
            if out.finish_reason is not None:  # the request ends at this token: nothing to hand on
                response.finished, response.finish_reason = True, out.finish_reason
                if progress is not None:  # the decode node's read ends with this trailer
                    progress.finish({"finished": True, "finish_reason": out.finish_reason})
            elif lease is not None:  # layer-wise: the decode node gets the token in the trailer
                self.leases.start_clock(lease)
                progress.finish(
                    {"finished": False, "token_id": response.first_token_id, "text_chars": len(response.text)}
                )
                kept = True
            else:
                lease = await self._lease(rid)
                response.kv.CopyFrom(self.senders.describe(lease))
                kept = True
            yield response
        finally:
            await asyncio.shield(self._settle(rid, compute, progress, lease, kept))

    async def _compute(self, rid: str, request: nodes_pb2.PrefillRequest, params, progress):
        prior = list(request.output_token_ids)  # a migrated request's tokens so far

        def add():
            self.llm.add_prefill(
                rid,
                list(request.prompt_token_ids),
                params,
                output_token_ids=prior,
                num_emitted_chars=request.num_emitted_chars if prior else None,
                kv_progress=progress,
            )

        outputs = [out async for out in self.engine.stream(rid, add)]
        return outputs[-1]  # a prefill has one output

    async def _lease(self, rid: str) -> Lease:
        held = await self.engine.call(self.llm.kv_lease, rid)
        digest = await asyncio.to_thread(kv_digest, self.llm.kv_cache.kv, held.block_table, held.num_tokens)
        return self.leases.add(rid, held.block_table, held.num_tokens, digest)

    async def _settle(self, rid: str, compute: asyncio.Future, progress, lease: Lease | None, kept: bool) -> None:
        """The call ended. Unless a decode node reads its KV, nothing of it stays: the engine
        request is aborted (its blocks freed), a layer-wise read fails, the lease ends."""
        if not compute.done():
            compute.cancel()
        if kept:
            return
        if progress is not None:
            progress.fail("prefill ended without a first token to decode from")
        if lease is None:
            await self.engine.call(self.llm.release_kv, rid)
        elif self.leases.pop(lease.lease_id) is not None:
            await self._end(lease)
        # else it ended already (its blocks freed then), or a read pins it: freed once the read ends

    # ---- kv_leases ------------------------------------------------------------------------------
    async def release(self, lease_id: str, key: str | None = None) -> bool:
        """5. released: ends a kv_lease (the decode side confirmed its read, or gave up); key: the
        caller's access key (None: this node's own planes, which checked it)."""
        lease = self.leases.pop(lease_id, key)
        if lease is None:
            return False
        await self._end(lease)
        return True

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.leases.ttl_s / 4))
            for lease in self.leases.pop_expired():
                if not lease.released:  # (a lease id names KV: not in logs)
                    log.warning(
                        "kv_lease of %s expired unread; freeing %d blocks", lease.request_id, len(lease.block_ids)
                    )
                await self._end(lease)

    async def _end(self, lease: Lease) -> None:
        await self.engine.call(self.llm.release_kv, lease.request_id)


def _first_token(out, start: float) -> nodes_pb2.PrefillResponse:
    response = nodes_pb2.PrefillResponse(
        first_token_id=out.token_ids[-1],
        text=out.new_text,
        finished=False,
        prefill_start=start,
        prefill_end=time.time(),
        cached_tokens=out.num_cached_tokens,
    )
    if out.logprobs:
        response.logprobs.CopyFrom(logprobs_to_proto(out.logprobs[-1]))
    return response


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
