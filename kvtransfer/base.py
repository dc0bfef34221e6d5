"""The transfer interface. A transport is one file holding both of its sides, as vLLM v1's KV
connectors and SGLang's disaggregation backends split them:

- its sender (the prefill node): makes the node's leased KV readable (a listener, a shared-memory
  region) and describes where, in the lease's KVSource; told when a lease ends;
- its reader (the decode node): moves one leased KV into blocks the decode node reserved;
- its Capabilities: layer-wise (reads a lease while its prefill still computes), partial (leaves
  out the leading blocks the reader's prefix cache already holds), one host only.

`Transport` ties them together; kvtransfer/transports.py registers each in one line. A KVTransfer
is the pollable, awaitable status of one read:
    WAITING -> TRANSFERRING -> SUCCESS
                            -> FAILED (error says why; the destination blocks hold garbage)
"""

from __future__ import annotations

import asyncio
import enum
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.block_manager import BlockManager
from engine.kv_cache import KVCache
from kvtransfer.layout import KVLayout
from kvtransfer.lease import Lease, LeaseTable
from kvtransfer.security import NONE, Security
from pdserve_api import common_pb2, nodes_pb2


class KVTransferError(RuntimeError):
    """The KV could not be read: the lease is gone, a peer failed, or the bytes were corrupt."""


class KVCorrupt(KVTransferError):
    """A digest did not match: never decode from these bytes."""


def host_id() -> str:
    """Equal for two processes that can share memory: one machine (boot) and one /dev/shm. A
    container or a network namespace with a /dev/shm of its own is another host, as it is to
    shared memory (the two-host tests and a Ray node per namespace run so)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        shm = os.stat("/dev/shm").st_dev
    except OSError:
        shm = 0
    return f"{socket.gethostname()}/{boot}/{shm}"


@dataclass(frozen=True)
class Capabilities:
    """What one side of a transport can do here (a node reports its sides' in NodeLoad)."""

    name: str
    layerwise: bool = False  # a lease whose prefill still computes, each layer as it is written
    partial: bool = False  # leaves out leading blocks the reader holds, and still verifies the rest
    same_host: bool = False  # only between processes on one host

    def to_proto(self) -> common_pb2.KVTransportInfo:
        return common_pb2.KVTransportInfo(
            name=self.name, layerwise=self.layerwise, partial=self.partial, same_host=self.same_host
        )

    @classmethod
    def from_proto(cls, m: common_pb2.KVTransportInfo) -> Capabilities:
        return cls(m.name, m.layerwise, m.partial, m.same_host)


# ---- the prefill side ---------------------------------------------------------------------
@dataclass
class SenderContext:
    """What a sender may use, given once the node's engine exists."""

    kv_cache: KVCache  # the one preallocated KV tensor, which never moves
    block_manager: BlockManager  # who owns which block (on_reuse: a block is about to be rewritten)
    layout: KVLayout
    leases: LeaseTable
    host: str  # the interface the node listens on
    security: Security
    grpc_server: Any  # the node's gRPC server: .add(add_servicer_to_server, servicer, service descriptor)
    release: Callable[[str], Awaitable[bool]]  # ends a lease (ReleaseKV): frees its blocks


class KVSender:
    """The prefill side of a transport. Lifecycle: __init__(options) -> allocate_kv (before the
    engine exists) -> attach -> start -> describe for each lease -> stop. The methods
    here do nothing: a sender overrides what its transport needs."""

    def allocate_kv(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        """register: the memory the engine's KV tensor must live in for this transport to read it
        in place (a uint8 tensor of nbytes), or None. One sender at most provides it."""
        return None

    def attach(self, ctx: SenderContext) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def capabilities(self) -> Capabilities | None:
        """What this node's sender offers now; None: nothing (e.g. no shared-memory region)."""
        raise NotImplementedError

    def describe(self, lease: Lease, source: nodes_pb2.KVSource) -> None:
        """Fills in this transport's part of a lease's descriptor (a layer-wise lease has
        source.layerwise set); a transport with no field of its own uses source.transport_params[name]."""


# ---- the decode side ----------------------------------------------------------------------
@dataclass
class ReaderContext:
    security: Security = NONE  # mutual TLS and the internal token towards prefill nodes
    options: Any = None  # the transport's reader options (its Transport.reader_options), or None
    channel: Callable[[str], Any] | None = None  # a cached gRPC channel to a prefill node's address


class KVReader(Protocol):
    name: str

    def capabilities(self) -> Capabilities: ...

    def can_read(self, source: nodes_pb2.KVSource, layout: KVLayout) -> bool:
        """Whether this reader can reach the source (same host, an address it speaks, ...)."""

    def can_skip(self, source: nodes_pb2.KVSource) -> bool:
        """Whether read() can leave out leading blocks (skip_blocks > 0) and still verify the rest."""

    async def read(
        self,
        source: nodes_pb2.KVSource,
        kv_cache: KVCache,
        layout: KVLayout,
        block_ids: list[int],
        skip_blocks: int = 0,
    ) -> dict | None:
        """Fills block_ids with the source's KV, verified against source.digest (per layer for a
        layer-wise source), or raises KVLayoutMismatch / KVCorrupt / KVTransferError; returns only
        once nothing it started can still write into block_ids. skip_blocks: the first blocks are
        not read (the decode node's prefix cache holds them: block_ids[:skip_blocks] are shared and
        must not be written), and what is read is verified by digests of its own. A reader that
        streams layers returns a layer-wise source's trailer: {finished, token_id, text_chars} or
        {finished: true, finish_reason}; others return None."""

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Transport:
    """One transport: its name (what --kv-transport calls it, and the metrics label), how to build
    each side, and the option classes of each side (serving/options.py makes them flags and Serve
    config keys of the prefill and the decode node)."""

    name: str
    sender: Callable[[Any], KVSender]  # (its sender options or None) -> the prefill node's sender
    reader: Callable[[ReaderContext], KVReader]
    sender_options: type | None = None
    reader_options: type | None = None
    sender_switch: str | None = None  # the sender option (a bool) that turns this transport off on a prefill node


def options_for(cls: type | None, given: tuple) -> Any:
    """The instance of an option class among `given` (a node's transport options), or its defaults."""
    if cls is None:
        return None
    return next((o for o in given if isinstance(o, cls)), None) or cls()


class TransferStatus(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class KVTransfer:
    def __init__(
        self,
        reader: KVReader,
        source: nodes_pb2.KVSource,
        kv_cache: KVCache,
        layout: KVLayout,
        block_ids: list[int],
        skip_blocks: int = 0,
    ):
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
            self.outcome = await reader.read(source, kv_cache, layout, block_ids, skip_blocks)
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
