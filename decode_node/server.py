"""The decode node: pulls each sequence's KV from its prefill node, then decodes it in the
continuous batch and streams the tokens. A request the router sends with prefill_locally (a
short uncached suffix, router/placement.py) is prefilled here instead, from this node's prefix
cache (_prefill_here).

Lifecycle of a request here (DecodeNode._decode_imported, a method per step):
  1. prealloc - blocks reserved for the prompt's KV, its cached prefix taken from this node's
                prefix cache where the transport can leave blocks out (waits while the pool is full)
  2. transfer - the KV is read from the prefill node straight into those blocks, digest-checked
                (kvtransfer/); the prefill node is told it may free its copy. A layer-wise source
                is read while its prefill still computes; its first token comes with the last layer
  3. running  - the sequence joins the decode batch between two steps; its tokens stream back
  4. finished - EOS, stop, length, or cancelled: the engine frees its blocks (a request never
                admitted gives them back once its transfer has settled)
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, replace

import grpc

from decode_node.config import DecodeConfig
from engine import EngineConfig, LLMEngine
from engine.config import DECODE_NODE_PREFILL_TOKENS
from kvtransfer.base import KVCorrupt, KVTransfer, KVTransferError, host_id
from kvtransfer.layout import KVLayout, KVLayoutMismatch, model_fingerprint
from kvtransfer.receiver import KVReceiver
from kvtransfer.security import NONE, Security
from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc
from serving.metrics import Metrics
from serving.node import EngineServer
from serving.protocol import logprobs_to_proto, sampling_from_proto

BLOCK_WAIT_S = 30.0  # how long a request may wait for free blocks without a deadline


@dataclass
class Reserved:
    """Blocks reserved for a request's KV; `owned` until the engine takes them over (admission)."""

    blocks: list[int]
    skip: int  # leading blocks taken from the prefix cache (not read)
    owned: bool = True
    transfer: KVTransfer | None = None  # what writes into them


class DecodeNode(EngineServer, nodes_pb2_grpc.DecodeNodeServicer):
    role = "decode"

    def __init__(
        self,
        engine_config: EngineConfig,
        config: DecodeConfig = DecodeConfig(),
        *,
        host: str = "127.0.0.1",
        metrics: Metrics | None = None,
        security: Security = NONE,
        kv_options: tuple = (),
        any_port_if_taken: bool = False,
    ):
        """kv_options: the KV transports' reader options (kvtransfer/transports.py)."""
        self.config = config
        if engine_config.prefill_tokens_with_decodes is None:  # local prefills a chunk a step beside decodes
            engine_config = replace(engine_config, prefill_tokens_with_decodes=DECODE_NODE_PREFILL_TOKENS)
        llm = LLMEngine(engine_config)
        super().__init__(llm, host, config.port, security, metrics, any_port_if_taken)
        self.server.add(
            nodes_pb2_grpc.add_DecodeNodeServicer_to_server, self, nodes_pb2.DESCRIPTOR.services_by_name["DecodeNode"]
        )
        self.layout = KVLayout.of(
            llm.kv_cache, model_fingerprint(llm.model_dir), llm.numerics, llm.model_config.attention
        )
        self.receiver = KVReceiver(llm.kv_cache, self.layout, config.kv_transport, security, kv_options)
        self.host_id = host_id()
        # Fault injection for chaos tests: a pause before each transfer (PDSERVE_FAULT_DELAY_TRANSFER_S),
        # and before each streamed message, so that streams are in flight when a host is lost
        # (PDSERVE_FAULT_DELAY_MESSAGE_S).
        self.fault_delay_transfer_s = float(os.environ.get("PDSERVE_FAULT_DELAY_TRANSFER_S", "0"))
        self.fault_delay_message_s = float(os.environ.get("PDSERVE_FAULT_DELAY_MESSAGE_S", "0"))
        self.num_active = 0  # Decode streams open: transferring or decoding
        # Totals for the planner's autoscaling (pdserve/autoscaling.py): requests streaming, and the
        # prompts prefilled here (local prefills are prefill demand too), their computed and cached tokens
        self.num_requests = self.num_local_prefills = self.local_new_tokens = self.local_cached_tokens = 0

    def num_open(self) -> int:
        return self.num_active

    def busy(self) -> bool:
        return bool(self.num_active)

    async def stop(self, grace: float = 1.0) -> None:
        await super().stop(grace)
        await self.receiver.close()

    # ---- DecodeNode service -----------------------------------------------------------------
    async def Decode(self, request: nodes_pb2.DecodeRequest, context):
        if self.num_active >= self.config.max_queued + self.llm.config.max_num_seqs:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode node at capacity ({self.num_active} streams open)"
            )
        self.num_active += 1
        try:
            params = await self._check(request, context)
            stream = self._prefill_here if request.prefill_locally else self._decode_imported
            started = False
            async for msg in stream(request, params, context):
                if not started:  # counted once it streams: not when refused, nor twice when retried
                    self.num_requests, started = self.num_requests + 1, True
                if self.fault_delay_message_s:
                    await asyncio.sleep(self.fault_delay_message_s)
                yield msg
        finally:
            self.num_active -= 1

    async def GetLoad(self, request, context) -> common_pb2.NodeLoad:
        return common_pb2.NodeLoad(
            **self.llm.load(),
            **self.llm.cache_changes(request.cache_since),
            host_id=self.host_id,
            kv_transports=[c.to_proto() for c in self.receiver.capabilities()],
        )

    # ---- a request's life -------------------------------------------------------------------
    async def _decode_imported(self, request: nodes_pb2.DecodeRequest, params, context):
        """1. to 4. (the module's docstring)."""
        reserved = await self._prealloc(request, params, context)
        try:
            transfer = await self._transfer(request.kv, reserved, context)
            output_token_ids, num_emitted_chars = list(request.output_token_ids), request.num_emitted_chars
            if transfer.outcome is not None and not params.forks:  # layer-wise: the prefill's first token
                if transfer.outcome["finished"]:  # nothing to decode; the prefill node ended the lease
                    yield nodes_pb2.DecodeResponse(finished=True, finish_reason=transfer.outcome["finish_reason"])
                    return
                output_token_ids.append(transfer.outcome["token_id"])
                num_emitted_chars += transfer.outcome["text_chars"]
            self._read(request.kv, transfer)
            async for msg in self._run(request, params, output_token_ids, num_emitted_chars, reserved, context):
                yield msg
        finally:
            if reserved.owned:  # 4. never admitted: the blocks go back once nothing writes them; one
                #                  shielded task, so that a cancellation cannot stop it half-way
                await asyncio.shield(self._give_back(reserved))

    async def _check(self, request: nodes_pb2.DecodeRequest, context):
        """The request's sampling parameters, or INVALID_ARGUMENT naming what is wrong."""
        try:
            params = sampling_from_proto(request.sampling)
            if request.prefill_locally and request.kv.lease_id:
                raise ValueError("a request prefilled locally carries no kv source")
            # n > 1: every sample draws its first token here, from the one imported KV
            if params.forks and request.output_token_ids:
                raise ValueError(
                    "output_token_ids must be empty with n, best_of or beam_width > 1: each sample "
                    "draws its first token on the decode node"
                )
            if not (request.prefill_locally or request.output_token_ids or request.kv.layerwise or params.forks):
                raise ValueError(
                    "output_token_ids must hold the token sampled by the prefill"
                )  # layer-wise: with the KV
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return params

    async def _prealloc(self, request: nodes_pb2.DecodeRequest, params, context) -> Reserved:
        """1. Blocks for the source's tokens. Where the transport can leave blocks out, the
        prompt's cached prefix (a conversation's earlier turns) comes from this node's prefix
        cache and only the rest is read."""
        source = request.kv
        try:
            partial = (
                self.llm.config.enable_prefix_caching
                and source.layout.block_size == self.llm.config.block_size
                and self.receiver.can_skip(source)
            )
        except KVTransferError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        kv_tokens = (
            (list(request.prompt_token_ids) + list(request.output_token_ids))[: source.num_tokens] if partial else None
        )
        give_up = request.deadline or time.time() + BLOCK_WAIT_S
        while True:
            try:
                reserved = await self.engine.call_or_undo(
                    lambda: self.llm.try_reserve_kv(source.num_tokens, kv_tokens, params.cache_salt),
                    lambda r: self.llm.free_kv(r[0]),
                )
            except ValueError as e:  # longer than this node can ever hold
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if reserved is not None:
                return Reserved(*reserved)
            if time.time() >= give_up:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"decode node out of KV blocks for {source.num_tokens} tokens "
                    f"({self.llm.block_manager.num_free_blocks} free)",
                )
            await asyncio.sleep(0.01)

    async def _transfer(self, source: nodes_pb2.KVSource, reserved: Reserved, context) -> KVTransfer:
        """2. The KV read into the reserved blocks (all but the cached ones), or the call aborted
        with the status the router acts on (UNAVAILABLE and DATA_LOSS: it migrates)."""
        if self.fault_delay_transfer_s:
            await asyncio.sleep(self.fault_delay_transfer_s)
        try:
            transfer = self.receiver.start(source, reserved.blocks, reserved.skip)
            reserved.transfer = transfer
            await transfer.wait()
        except KVLayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except KVCorrupt as e:
            await context.abort(grpc.StatusCode.DATA_LOSS, str(e))
        except KVTransferError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return transfer

    def _read(self, source: nodes_pb2.KVSource, transfer: KVTransfer) -> None:
        """The KV is in place: the prefill node may free its copy; the transfer is measured."""
        self.background(self.receiver.release(source), cancel_on_stop=False)
        self.metrics.observe("pdserve_kv_transfer_seconds", transfer.seconds, transport=transfer.transport)
        self.metrics.observe("pdserve_kv_transfer_bytes", transfer.num_bytes, transport=transfer.transport)
        if transfer.seconds > 0:
            gbps = transfer.num_bytes / transfer.seconds / 1e9
            self.metrics.set("pdserve_kv_transfer_gbps", gbps, transport=transfer.transport)

    async def _run(
        self,
        request: nodes_pb2.DecodeRequest,
        params,
        output_token_ids: list[int],
        num_emitted_chars: int,
        reserved: Reserved,
        context,
    ):
        """3. running: from the moment the admission is queued the engine owns the blocks (it frees
        them if the admission fails or the request is aborted)."""
        admitted = []

        def admit():  # in the engine thread, between two steps: the next step decodes it
            admitted.append(time.time())
            self.llm.add_prefilled_request(
                request.request_id,
                list(request.prompt_token_ids),
                output_token_ids,
                params,
                reserved.blocks,
                num_emitted_chars=num_emitted_chars,
            )

        first = True
        reserved.owned = False  # no await between this and the admission being queued
        try:
            async for out in self.engine.stream(request.request_id, admit):
                msg = _response(out)
                if first:
                    transfer = reserved.transfer
                    msg.transfer_start, msg.transfer_end = transfer.started, transfer.ended
                    msg.decode_admitted, msg.kv_transport = admitted[0], transfer.transport
                    msg.kv_bytes, msg.cached_tokens = transfer.num_bytes, transfer.skipped_tokens
                    first = False
                yield msg
        except ValueError as e:  # refused at admission (e.g. the request id is in use)
            if not admitted:  # refused before admit ran (a live id): the blocks are still ours to give back
                reserved.owned = True
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _prefill_here(self, request: nodes_pb2.DecodeRequest, params, context):
        """Conditional disaggregation: the prompt's KV computed here, in the continuous batch
        (a mixed step), from the longest prefix this node's cache holds; then decoding goes on."""
        prior = list(request.output_token_ids)  # a migrated request's tokens so far: recomputed
        start = time.time()
        first = True
        try:
            async for out in self.engine.stream(
                request.request_id,
                lambda: self.llm.add_request(
                    request.request_id,
                    list(request.prompt_token_ids),
                    params,
                    output_token_ids=prior,
                    num_emitted_chars=request.num_emitted_chars if prior else None,
                ),
            ):
                msg = _response(out)
                if first:
                    msg.prefill_start, msg.prefill_end = start, time.time()
                    msg.decode_admitted, msg.cached_tokens = start, out.num_cached_tokens
                    self.num_local_prefills += 1
                    self.local_new_tokens += len(request.prompt_token_ids) + len(prior) - out.num_cached_tokens
                    self.local_cached_tokens += out.num_cached_tokens
                    first = False
                yield msg
        except ValueError as e:  # refused at admission: names what is wrong
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _give_back(self, reserved: Reserved) -> None:
        if reserved.transfer is not None:
            await reserved.transfer.settle()
        await self.engine.call(self.llm.free_kv, reserved.blocks)


def _response(out) -> nodes_pb2.DecodeResponse:
    """One engine output as a Decode stream message."""
    msg = nodes_pb2.DecodeResponse(
        token_ids=out.new_token_ids,
        text=out.new_text,
        finished=out.last,
        finish_reason=out.finish_reason or "",
        index=out.index,
    )
    if out.logprobs:  # one entry per new token (several after a verified draft)
        msg.logprobs.extend(logprobs_to_proto(lp) for lp in out.logprobs[-len(out.new_token_ids) :])
    return msg
