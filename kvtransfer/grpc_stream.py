"""The `grpc` transport: a gRPC stream (works across hosts; whole finished leases only).

Sender (the prefill node's KVPlane service): gathers a leased KV's layer-ordered stream into a
staging buffer and streams it as ~1 MiB raw-bytes chunks, each with its xxh3_64; the first chunk
carries a header (layout, model fingerprint, token count, size, digest of the whole stream).
Receiver (the decode node): checks the header against its own layout before any byte is
written, checks every chunk's digest and offset, writes each chunk straight into its reserved
(preallocated) KV blocks, and checks the whole-stream digest at the end.
"""

from __future__ import annotations

import asyncio
import warnings

import grpc
import torch
import xxhash

from engine.kv_cache import KVCache
from kvtransfer.base import Capabilities, KVCorrupt, KVSender, KVTransferError, SenderContext, Transport
from kvtransfer.buffers import BufferPool
from kvtransfer.layout import KVLayout, KVLayoutMismatch, StreamWriter, gather, kv_digest
from kvtransfer.lease import LeaseTable
from kvtransfer.security import INTERNAL_CHANNEL_OPTIONS, MAX_MESSAGE_BYTES, NONE, Security
from pdserve_api import nodes_pb2, nodes_pb2_grpc

# torch warns that the chunk's bytes are read-only; they are only ever read.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

CHUNK_BYTES = 1 << 20  # measured best here: 4 MiB chunks were 20-30% slower, unary 2.5-3x


class GrpcSender(KVSender):
    """The KVPlane service, on the prefill node's own gRPC server."""

    def __init__(self, options=None):
        pass

    def attach(self, ctx: SenderContext) -> None:
        ctx.grpc_server.add(
            nodes_pb2_grpc.add_KVPlaneServicer_to_server,
            KVPlaneServicer(ctx.kv_cache, ctx.layout, ctx.leases),
            nodes_pb2.DESCRIPTOR.services_by_name["KVPlane"],
        )

    def capabilities(self) -> Capabilities:
        return CAPABILITIES  # its address is the node's own (KVSource.kv_address)


class KVPlaneServicer(nodes_pb2_grpc.KVPlaneServicer):
    def __init__(self, kv_cache: KVCache, layout: KVLayout, leases: LeaseTable, prealloc_tokens: int = 2048):
        self.kv_cache = kv_cache
        self.layout = layout
        self.leases = leases
        self.buffers = BufferPool(layout.num_bytes(prealloc_tokens))  # send staging, grown on demand

    async def PullKV(self, request: nodes_pb2.PullKVRequest, context: grpc.aio.ServicerContext):
        lease = self.leases.get(request.lease_id, request.access_key)
        if lease is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no kv_lease {request.lease_id!r} (released or expired)")
        if lease.progress is not None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"kv_lease {request.lease_id!r} streams layer by layer: read it over tcp",
            )
        try:
            self.layout.check(KVLayout.from_proto(request.expect), sides=("prefill", "decode"))
        except KVLayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        chunk = request.chunk_bytes or CHUNK_BYTES
        if not 0 < chunk <= MAX_MESSAGE_BYTES - 4096:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"chunk_bytes must be in (0, {MAX_MESSAGE_BYTES - 4096}]"
            )
        nbytes = self.layout.num_bytes(lease.num_tokens)
        if self.leases.pin(request.lease_id, request.access_key) is None:  # expired during the checks
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no kv_lease {request.lease_id!r} (released or expired)")
        buf = self.buffers.acquire(nbytes)
        try:
            try:  # pinned: the lease does not expire (its blocks are not reused) under the copy
                data = await asyncio.to_thread(gather, self.kv_cache.kv, lease.block_ids, lease.num_tokens, buf)
            finally:
                self.leases.unpin(lease)
            view = data.numpy()
            header = nodes_pb2.KVHeader(
                layout=self.layout.to_proto(), num_tokens=lease.num_tokens, num_bytes=nbytes, digest=lease.digest
            )
            for offset in range(0, nbytes, chunk):
                piece = view[offset : offset + chunk].tobytes()
                yield nodes_pb2.KVChunk(
                    header=header if offset == 0 else None,
                    offset=offset,
                    data=piece,
                    digest=xxhash.xxh3_64_intdigest(piece),
                )
        finally:
            self.buffers.release(buf)


class GrpcStreamReader:
    name = "grpc"

    def __init__(
        self, chunk_bytes: int = CHUNK_BYTES, security: Security = NONE, timeout_s: float = 60.0, channel=None
    ):
        """channel(address): a gRPC channel to a prefill node (the decode node's, shared with its
        control plane); default: channels of its own, with `security` (mutual TLS, the token)."""
        self.chunk_bytes = chunk_bytes
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.security = security
        self.timeout_s = timeout_s  # a pull that takes longer fails (never a hang)
        self.channel = channel or self._channel

    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def can_read(self, source: nodes_pb2.KVSource, layout: KVLayout) -> bool:
        return bool(source.kv_address) and not source.layerwise

    def can_skip(self, source: nodes_pb2.KVSource) -> bool:
        return False  # its check is the whole stream's digest

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            self.channels[address] = self.security.channel(address, INTERNAL_CHANNEL_OPTIONS)
        return self.channels[address]

    async def read(
        self,
        source: nodes_pb2.KVSource,
        kv_cache: KVCache,
        layout: KVLayout,
        block_ids: list[int],
        skip_blocks: int = 0,
    ) -> None:
        if skip_blocks:
            raise KVTransferError("the grpc transport reads whole leases")
        stub = nodes_pb2_grpc.KVPlaneStub(self.channel(source.kv_address))
        nbytes = layout.num_bytes(source.num_tokens)
        writer = StreamWriter(kv_cache.kv, block_ids, source.num_tokens)  # straight into the blocks
        request = nodes_pb2.PullKVRequest(
            lease_id=source.lease_id,
            expect=layout.to_proto(),
            chunk_bytes=self.chunk_bytes,
            access_key=source.access_key,
        )
        try:
            async for chunk in stub.PullKV(request, timeout=self.timeout_s):
                if chunk.HasField("header"):
                    # The header is checked before any byte is written.
                    layout.check(KVLayout.from_proto(chunk.header.layout))
                    if chunk.header.num_tokens != source.num_tokens or chunk.header.num_bytes != nbytes:
                        raise KVTransferError(
                            f"KV header says {chunk.header.num_tokens} tokens / "
                            f"{chunk.header.num_bytes} bytes, expected {source.num_tokens} / {nbytes}"
                        )
                elif writer.offset == 0:
                    raise KVTransferError("KV stream did not start with a header")
                if chunk.offset != writer.offset or chunk.offset + len(chunk.data) > nbytes:
                    raise KVTransferError(
                        f"KV chunk at offset {chunk.offset} ({len(chunk.data)} bytes) out of order "
                        f"or past {nbytes} bytes"
                    )
                if xxhash.xxh3_64_intdigest(chunk.data) != chunk.digest:
                    raise KVCorrupt(f"KV chunk at offset {chunk.offset} failed its digest")
                writer.write(torch.frombuffer(chunk.data, dtype=torch.uint8))  # read-only view, no copy
        except grpc.aio.AioRpcError as e:
            raise KVTransferError(f"KV pull from {source.kv_address} failed: {e.code().name}: {e.details()}") from e
        if writer.offset != nbytes:
            raise KVTransferError(f"KV stream ended after {writer.offset} of {nbytes} bytes")
        digest = await asyncio.to_thread(kv_digest, kv_cache.kv, block_ids, source.num_tokens)
        if digest != source.digest:
            raise KVCorrupt(f"KV digest mismatch after the gRPC stream (lease {source.lease_id})")

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        self.channels.clear()


CAPABILITIES = Capabilities("grpc")
TRANSPORT = Transport(
    "grpc", sender=GrpcSender, reader=lambda ctx: GrpcStreamReader(security=ctx.security, channel=ctx.channel)
)
