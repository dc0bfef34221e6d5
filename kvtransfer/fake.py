"""An in-process transport for unit tests: the "remote" KV cache is a Python object registered
under a name, and reading is a block copy. Same checks as the real transports."""

from __future__ import annotations

from engine.kv_cache import KVCache
from kvtransfer.base import KVCorrupt, KVTransferError
from kvtransfer.layout import KVLayout, copy_blocks
from pdserve_api import nodes_pb2

REGISTRY: dict[str, KVCache] = {}  # "fake://name" -> a prefill engine's KV cache


class FakeReader:
    name = "fake"

    def can_read(self, source: nodes_pb2.KVSource, layout: KVLayout) -> bool:
        return source.kv_address.startswith("fake://")

    async def read(self, source: nodes_pb2.KVSource, kv_cache: KVCache, layout: KVLayout,
                   block_ids: list[int]) -> None:
        layout.check(KVLayout.from_proto(source.layout), same_block_size=True)
        src = REGISTRY.get(source.kv_address)
        if src is None:
            raise KVTransferError(f"no fake KV source {source.kv_address}")
        digest = copy_blocks(src.kv, list(source.block_ids), kv_cache.kv, block_ids[:len(source.block_ids)],
                             source.num_tokens)
        if digest != source.digest:
            raise KVCorrupt(f"KV digest mismatch (lease {source.lease_id})")
