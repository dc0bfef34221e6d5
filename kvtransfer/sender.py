"""The prefill side: every registered transport's sender, serving this node's leased KV.

Lifecycle (kvtransfer/base.py KVSender):
  1. register  - before the engine exists, a transport that reads the KV tensor in place may
                 provide the memory it lives in (`allocator`: shm's /dev/shm region)
  2. attach    - each sender gets the KV cache, the leases and the node's gRPC server; then start
  3. describe  - a lease's KVSource: the control plane's fields, then each sender's own
  4. stop
"""

from __future__ import annotations

import torch

from kvtransfer import transports
from kvtransfer.base import Capabilities, KVSender, SenderContext, host_id, options_for
from kvtransfer.lease import Lease
from pdserve_api import nodes_pb2


class KVSenders:
    def __init__(self, options: tuple = ()):
        """options: the transports' sender options (their defaults where not given)."""
        self.senders: list[KVSender] = [
            t.sender(options_for(t.sender_options, options)) for t in transports.TRANSPORTS.values()
        ]
        self.host_id = host_id()
        self.ctx: SenderContext | None = None

    def allocator(self, device: torch.device):
        """kv_allocator(nbytes) for the engine: memory of the first sender that reads the KV tensor
        in place, or None (the engine allocates it on its device)."""

        def allocate(nbytes: int) -> torch.Tensor | None:
            return next((m for m in (s.allocate_kv(nbytes, device) for s in self.senders) if m is not None), None)

        return allocate

    def attach(self, ctx: SenderContext) -> None:
        self.ctx = ctx
        for sender in self.senders:
            sender.attach(ctx)

    async def start(self) -> None:
        for sender in self.senders:
            await sender.start()

    async def stop(self) -> None:
        for sender in self.senders:
            await sender.stop()

    def capabilities(self) -> list[Capabilities]:
        """The transports this node serves its leases over now (its NodeLoad reports them)."""
        return [c for c in (s.capabilities() for s in self.senders) if c is not None]

    def describe(self, lease: Lease, layerwise: bool = False) -> nodes_pb2.KVSource:
        """The descriptor a decode node reads the lease with. A layer-wise lease (its prefill still
        computes) carries no whole-KV digest: each layer comes with its own."""
        ctx = self.ctx
        source = nodes_pb2.KVSource(
            lease_id=lease.lease_id,
            kv_address=ctx.grpc_server.address,
            host_id=self.host_id,
            layout=ctx.layout.to_proto(),
            block_ids=lease.block_ids,
            num_tokens=lease.num_tokens,
            digest=lease.digest,
            num_bytes=ctx.layout.num_bytes(lease.num_tokens),
            lease_expires=min(lease.expires_at, 1e12),
            access_key=lease.access_key,
            layerwise=layerwise,
        )
        for sender in self.senders:
            sender.describe(lease, source)
        return source
