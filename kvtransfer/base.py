"""The transfer interface: a reader moves one leased KV into local blocks; a KVTransfer is the
pollable, awaitable status of one such move.

Status ladder (as in SGLang's disaggregation backends):
    WAITING -> TRANSFERRING -> SUCCESS
                            -> FAILED (error says why; the destination blocks hold garbage)
"""

from __future__ import annotations

import asyncio
import enum
import time
from typing import Protocol

from engine.kv_cache import KVCache
from kvtransfer.layout import KVLayout
from pdserve_api import nodes_pb2


class KVTransferError(RuntimeError):
    """The KV could not be read: the lease is gone, a peer failed, or the bytes were corrupt."""


class KVCorrupt(KVTransferError):
    """A digest did not match: never decode from these bytes."""


class TransferStatus(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class KVReader(Protocol):
    """Decode side of a transport. Adding a transport is adding one such class."""

    name: str

    def can_read(self, source: nodes_pb2.KVSource, layout: KVLayout) -> bool: ...

    def can_skip(self, source: nodes_pb2.KVSource) -> bool:
        """Whether read() can leave out leading blocks (skip_blocks > 0) and still verify the rest."""

    async def read(self, source: nodes_pb2.KVSource, kv_cache: KVCache, layout: KVLayout,
                   block_ids: list[int], skip_blocks: int = 0) -> dict | None:
        """Fills block_ids with the source's KV, verified against source.digest (per layer for a
        layer-wise source), or raises. skip_blocks: the first blocks are not read (the decode node's
        prefix cache holds them: block_ids[:skip_blocks] are shared and must not be written), and
        what is read is verified by digests of its own. A transport that can read a layer-wise
        source (one whose prefill still computes) returns its trailer: {finished, token_id,
        text_chars} or {finished: true, finish_reason}; others return None and refuse such sources
        in can_read."""


class KVTransfer:
    def __init__(self, reader: KVReader, source: nodes_pb2.KVSource, kv_cache: KVCache, layout: KVLayout,
                 block_ids: list[int], skip_blocks: int = 0):
        self.transport = reader.name + ("-layerwise" if source.layerwise else "")
        self.skipped_tokens = min(skip_blocks * layout.block_size, source.num_tokens)
        self.num_bytes = layout.num_bytes(source.num_tokens - self.skipped_tokens)
        self.status = TransferStatus.WAITING
        self.error: BaseException | None = None
        self.started = self.ended = 0.0
        self.outcome: dict | None = None  # a layer-wise source's trailer: the prefill's first token
        self._task = asyncio.ensure_future(self._run(reader, source, kv_cache, layout, block_ids, skip_blocks))
        # A transfer whose waiter went away (a cancelled request) may still fail: that is no error.
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _run(self, reader, source, kv_cache, layout, block_ids, skip_blocks) -> None:
        self.status = TransferStatus.TRANSFERRING
        self.started = time.time()
        try:
            if skip_blocks:
                self.outcome = await reader.read(source, kv_cache, layout, block_ids, skip_blocks)
            else:
                self.outcome = await reader.read(source, kv_cache, layout, block_ids)
        except BaseException as e:
            self.status, self.error = TransferStatus.FAILED, e
            raise
        finally:
            self.ended = time.time()
        self.status = TransferStatus.SUCCESS

    async def wait(self) -> None:
        """Returns once the KV is in place; raises what made it fail."""
        await asyncio.shield(self._task)

    async def settle(self) -> None:
        """Waits until the transfer has stopped touching the destination blocks, however it ended.
        A transfer is never cancelled half-way: its blocks may only be freed after this."""
        await asyncio.wait([self._task])

    @property
    def seconds(self) -> float:
        return self.ended - self.started
