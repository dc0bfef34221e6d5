"""A KV transport for tests, in one file as every transport is (kvtransfer/base.py): both
sides, their capabilities, nothing else. Register it with one line,

    transports.register(fake_transport.TRANSPORT)

and `--kv-transport fake` (or auto, after the others) moves KV between nodes in one process: the
sender registers its KV cache under a name it puts in the lease's descriptor; the reader copies the
leased blocks out of it, with the same checks as the real transports."""

from __future__ import annotations

import uuid

from engine.kv_cache import KVCache
from kvtransfer.base import Capabilities, KVCorrupt, KVSender, KVTransferError, SenderContext, Transport
from kvtransfer.layout import KVLayout, copy_blocks
from kvtransfer.lease import Lease
from pdserve_api import nodes_pb2

NAME = "fake"
REGISTRY: dict[str, KVCache] = {}  # name -> a prefill node's KV cache, in this process
CAPABILITIES = Capabilities(NAME, same_host=True)


class FakeSender(KVSender):
    def __init__(self, options=None):
        self.name = f"fake-{uuid.uuid4().hex[:8]}"

    def attach(self, ctx: SenderContext) -> None:
        REGISTRY[self.name] = ctx.kv_cache

    async def stop(self) -> None:
        REGISTRY.pop(self.name, None)

    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def describe(self, lease: Lease, source: nodes_pb2.KVSource) -> None:
        if not source.layerwise:
            source.transport_params[NAME] = self.name.encode()


class FakeReader:
    name = NAME

    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def can_read(self, source: nodes_pb2.KVSource, layout: KVLayout) -> bool:
        return source.transport_params.get(NAME, b"").decode() in REGISTRY

    def can_skip(self, source: nodes_pb2.KVSource) -> bool:
        return False

    async def read(
        self,
        source: nodes_pb2.KVSource,
        kv_cache: KVCache,
        layout: KVLayout,
        block_ids: list[int],
        skip_blocks: int = 0,
    ) -> None:
        layout.check(KVLayout.from_proto(source.layout), same_block_size=True)
        src = REGISTRY.get(source.transport_params.get(NAME, b"").decode())
        if src is None:
            raise KVTransferError(f"no fake KV source for lease {source.lease_id}")
        digest = copy_blocks(
            src.kv, list(source.block_ids), kv_cache.kv, block_ids[: len(source.block_ids)], source.num_tokens
        )
        if digest != source.digest:
            raise KVCorrupt(f"KV digest mismatch (lease {source.lease_id})")

    async def close(self) -> None:
        pass


TRANSPORT = Transport(NAME, sender=FakeSender, reader=lambda ctx: FakeReader())
