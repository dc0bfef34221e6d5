"""The decode side: its readers (one per transport it may use, in order of preference), the
transfer of one leased KV into reserved blocks, and the control plane back to the prefill node
(ReleaseKV)."""

from __future__ import annotations

import logging

import grpc

from engine.kv_cache import KVCache
from kvtransfer import transports
from kvtransfer.base import Capabilities, KVReader, KVTransfer, KVTransferError, ReaderContext, options_for
from kvtransfer.layout import KVLayout
from kvtransfer.security import INTERNAL_CHANNEL_OPTIONS, NONE, Security
from pdserve_api import nodes_pb2, nodes_pb2_grpc

log = logging.getLogger(__name__)


class KVReceiver:
    def __init__(
        self,
        kv_cache: KVCache,
        layout: KVLayout,
        transport: str = "auto",
        security: Security = NONE,
        options: tuple = (),
    ):
        """transport: auto (every registered transport, first that can reach a source wins) or
        one name; options: the transports' reader options (their defaults where not given)."""
        self.kv_cache = kv_cache
        self.layout = layout
        self.security = security
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.readers: list[KVReader] = [
            t.reader(ReaderContext(security, options_for(t.reader_options, options), self.channel))
            for t in transports.named(transport)
        ]
        self.transport = transport

    def capabilities(self) -> list[Capabilities]:
        """What this node reads with, preferred first (its NodeLoad reports them)."""
        return [r.capabilities() for r in self.readers]

    def channel(self, address: str) -> grpc.aio.Channel:
        """A gRPC channel to a prefill node (mutual TLS and the token where configured)."""
        if address not in self._channels:
            self._channels[address] = self.security.channel(address, INTERNAL_CHANNEL_OPTIONS)
        return self._channels[address]

    def choose(self, source: nodes_pb2.KVSource) -> KVReader:
        for reader in self.readers:
            if reader.can_read(source, self.layout):
                return reader
        layerwise = " layer by layer" if source.layerwise else ""
        raise KVTransferError(
            f"no {self.transport} transport can read the KV of lease {source.lease_id}{layerwise} "
            f"(host {source.host_id!r}, address {source.kv_address!r})"
        )

    def can_skip(self, source: nodes_pb2.KVSource) -> bool:
        """Whether a read of this source can leave out blocks this node's prefix cache holds."""
        return self.choose(source).can_skip(source)

    def start(self, source: nodes_pb2.KVSource, block_ids: list[int], skip_blocks: int = 0) -> KVTransfer:
        """Begins moving the source's KV into block_ids (all but the first skip_blocks, which this
        node already holds: only where can_skip); await .wait() or poll .status."""
        reader = self.choose(source)
        if skip_blocks and not reader.can_skip(source):
            raise KVTransferError(
                f"the {reader.name} transport cannot leave out cached blocks of lease {source.lease_id}"
            )
        return KVTransfer(reader, source, self.kv_cache, self.layout, block_ids, skip_blocks)

    async def release(self, source: nodes_pb2.KVSource) -> None:
        """Tells the prefill node it may free its copy of the KV (else its lease expires)."""
        try:
            stub = nodes_pb2_grpc.PrefillNodeStub(self.channel(source.kv_address))
            request = nodes_pb2.ReleaseKVRequest(lease_id=source.lease_id, access_key=source.access_key)
            await stub.ReleaseKV(request, timeout=5)
        except grpc.aio.AioRpcError as e:
            log.warning("ReleaseKV at %s failed: %s", source.kv_address, e.code().name)

    async def close(self) -> None:
        for reader in self.readers:
            await reader.close()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
