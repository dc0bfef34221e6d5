"""Moves a sequence's KV from a prefill engine's blocks into a decode engine's blocks.

Transports, one file each: `shm` (one-sided reads on one host), `tcp` (the raw TCP data plane,
across hosts), `grpc_stream` (gRPC, across hosts), `fake` (tests); the interface and how to add
one: docs/kv_transfer.md. The prefill side keeps the KV under a kv_lease (`lease.py`) until the
decode side confirms.
"""
