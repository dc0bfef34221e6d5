"""The prefill side's kv_leases: a finished prefill's KV stays in its blocks until the decode side
confirms its read (ReleaseKV) or the lease expires, then the blocks are freed. A layer-wise lease
begins while its prefill still computes (`progress`); its clock starts when the prefill ends.
A read in flight pins its lease (`pin`/`unpin`): it does not expire under the read (its blocks
could be reused while their bytes are still being sent), it expires once the read has ended; a
release while it is pinned takes no new read and frees the blocks once the last read ends. Outside
the node a lease is found only with its access key (`key`), on every plane.
The table is shared by the event loop and the TCP plane's threads, under one lock."""

from __future__ import annotations

import hmac
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field

from engine.kv_progress import LayerProgress


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
    progress: LayerProgress | None = None  # layer-wise: the KV as it is written
    readers: int = 0  # reads in flight (pin): the lease does not expire under them
    released: bool = False  # released while pinned: freed as its last read ends (pop_expired)


class LeaseTable:
    def __init__(self, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"kv lease ttl must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._leases)

    def add(
        self, request_id: str, block_ids: list[int], num_tokens: int, digest: int, progress: LayerProgress | None = None
    ) -> Lease:
        """With progress (the prefill still computes) the lease never expires until `start_clock`."""
        expires = float("inf") if progress is not None else time.time() + self.ttl_s
        lease = Lease(request_id, block_ids, num_tokens, digest, expires, progress=progress)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def start_clock(self, lease: Lease) -> None:
        with self._lock:
            if not lease.released:  # released while pinned: it stays ended
                lease.expires_at = time.time() + self.ttl_s

    def get(self, lease_id: str, key: str | None = None) -> Lease | None:
        """key: the caller's access key, for a caller outside this node (None: the node's own)."""
        with self._lock:
            return self._valid(lease_id, key)

    def pin(self, lease_id: str, key: str | None = None) -> Lease | None:
        """The lease, held against expiry until `unpin` (a read of its blocks in flight)."""
        with self._lock:
            lease = self._valid(lease_id, key)
            if lease is not None:
                lease.readers += 1
            return lease

    def unpin(self, lease: Lease) -> None:
        with self._lock:
            lease.readers -= 1

    def _valid(self, lease_id: str, key: str | None = None) -> Lease | None:
        lease = self._found(lease_id, key)
        if lease is None or lease.expires_at < time.time():  # an expired lease takes no new read
            return None
        return lease

    def _found(self, lease_id: str, key: str | None) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is not None and key is not None and not hmac.compare_digest(key.encode(), lease.access_key.encode()):
            return None  # as if there were none: a wrong key learns nothing
        return lease

    def pop(self, lease_id: str, key: str | None = None) -> Lease | None:
        """Ends the lease and returns it for its blocks to be freed; None if there is none (or the
        key is wrong), or if a read still pins it: then it takes no new read, and pop_expired
        returns it once the read ends."""
        with self._lock:
            lease = self._found(lease_id, key)
            if lease is None:
                return None
            if lease.readers:
                lease.released, lease.expires_at = True, float("-inf")
                return None
            return self._leases.pop(lease_id)

    def pop_expired(self, now: float | None = None) -> list[Lease]:
        now = time.time() if now is None else now
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.expires_at < now and not lease.readers]
            for lease in expired:
                del self._leases[lease.lease_id]
        return expired
