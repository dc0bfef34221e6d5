"""The prefill side's kv_leases: a finished prefill's KV stays in its blocks until the decode side
confirms its read (ReleaseKV) or the lease expires, then the blocks are freed."""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    digest: int
    expires_at: float
    lease_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # A secret per lease (as an RDMA rkey): only a holder of the KVSource may read the blocks.
    access_key: str = field(default_factory=lambda: secrets.token_hex(16))


class LeaseTable:
    def __init__(self, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"kv lease ttl must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, request_id: str, block_ids: list[int], num_tokens: int, digest: int) -> Lease:
        lease = Lease(request_id, block_ids, num_tokens, digest, time.time() + self.ttl_s)
        self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at < time.time():
            return None
        return lease

    def pop(self, lease_id: str) -> Lease | None:
        return self._leases.pop(lease_id, None)

    def pop_expired(self, now: float | None = None) -> list[Lease]:
        now = time.time() if now is None else now
        expired = [lease for lease in self._leases.values() if lease.expires_at < now]
        for lease in expired:
            del self._leases[lease.lease_id]
        return expired
