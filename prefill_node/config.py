"""The prefill node's options (serving/options.py derives its flags and its Serve config section);
the KV transports' own (a port, shared memory) are declared with each transport (kvtransfer/)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import option


@dataclass(frozen=True)
class PrefillConfig:
    port: int = option(
        0,
        "the node's gRPC port (0: any, printed in the READY line); under Serve, preferred (a "
        "taken port falls back to any)",
        per_process=True,
    )
    lease_ttl_s: float = option(30.0, "free a prefill's KV if unread this long (seconds)")
    max_pending: int = option(512, "prefills waiting or running before RESOURCE_EXHAUSTED")
    drain_timeout_s: float = option(
        60.0,
        "a replica being removed stops taking work and waits this long for its prefills and leases to end",
        where=("serve",),
    )

    def __post_init__(self):
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0 seconds, got {self.lease_ttl_s}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
