"""The decode node's options (serving/options.py derives its flags and its Serve config section);
the KV transports' own are declared with each transport (kvtransfer/)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import option
from kvtransfer import transports


@dataclass(frozen=True)
class DecodeConfig:
    port: int = option(
        0,
        "the node's gRPC port (0: any, printed in the READY line); under Serve, preferred (a "
        "taken port falls back to any)",
        per_process=True,
    )
    kv_transport: str = option(
        "auto",
        "how KV is read: auto takes the first transport that can reach the prefill "
        "node (shared memory on one host, else the raw TCP data plane, else gRPC)",
        choices=transports.CHOICES,
    )
    max_queued: int = option(
        512, "streams waiting for KV blocks or their transfer, beyond the batch, before RESOURCE_EXHAUSTED"
    )
    drain_timeout_s: float = option(
        600.0,
        "a replica being removed stops taking work and lets its streams finish "
        "this long; keep it longer than the longest allowed generation",
        where=("serve",),
    )

    def __post_init__(self):
        transports.named(self.kv_transport)  # raises naming the registered transports
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
