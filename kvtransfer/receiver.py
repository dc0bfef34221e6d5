"""The decode side: picks a transport for each KV source and starts the transfer."""

from __future__ import annotations

from engine.kv_cache import KVCache
from kvtransfer.base import KVReader, KVTransfer, KVTransferError
from kvtransfer.fake import FakeReader
from kvtransfer.grpc_stream import GrpcStreamReader
from kvtransfer.layout import KVLayout
from kvtransfer.shm import ShmReader
from kvtransfer.tcp import DEFAULT_CONNECTIONS, TcpReader
from pdserve.security import NONE, Security
from pdserve_api import nodes_pb2

TRANSPORTS = ("auto", "shm", "tcp", "grpc")  # auto: shm on one host, else tcp (grpc if no tcp plane)


class KVReceiver:
    def __init__(self, kv_cache: KVCache, layout: KVLayout, transport: str = "auto", security: Security = NONE,
                 tcp_connections: int = DEFAULT_CONNECTIONS):
        if transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {TRANSPORTS}, got {transport!r}")
        self.kv_cache = kv_cache
        self.layout = layout
        self.transport = transport
        self.grpc = GrpcStreamReader(security=security)
        # Preference order for "auto": the one-sided read when the source is on this host, then
        # the raw TCP data plane, then the gRPC stream.
        self.readers: list[KVReader] = [FakeReader(), ShmReader(), TcpReader(security, tcp_connections), self.grpc]

    def choose(self, source: nodes_pb2.KVSource) -> KVReader:
        for reader in self.readers:
            if self.transport in ("auto", reader.name) or reader.name == "fake":
                if reader.can_read(source, self.layout):
                    return reader
        layerwise = " layer by layer (tcp only)" if source.layerwise else ""
        raise KVTransferError(f"no {self.transport} transport can read the KV of lease {source.lease_id}{layerwise} "
                              f"(host {source.host_id!r}, region {source.shm_region!r}, tcp {source.tcp_address!r}, "
                              f"address {source.kv_address!r})")

    def can_skip(self, source: nodes_pb2.KVSource) -> bool:
        """Whether a read of this source can leave out blocks this node's prefix cache holds."""
        reader = self.choose(source)
        return getattr(reader, "can_skip", lambda s: False)(source)

    def start(self, source: nodes_pb2.KVSource, block_ids: list[int], skip_blocks: int = 0) -> KVTransfer:
        """Begins moving the source's KV into block_ids (all but the first skip_blocks, which this
        node already holds: only where can_skip); await .wait() or poll .status."""
        reader = self.choose(source)
        if skip_blocks and not getattr(reader, "can_skip", lambda s: False)(source):
            raise KVTransferError(f"the {reader.name} transport cannot leave out cached blocks of lease "
                                  f"{source.lease_id}")
        return KVTransfer(reader, source, self.kv_cache, self.layout, block_ids, skip_blocks)

    async def close(self) -> None:
        await self.grpc.close()
