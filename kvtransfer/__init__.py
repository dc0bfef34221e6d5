"""Moves a sequence's KV from a prefill engine's blocks into a decode engine's blocks.

Transports: `grpc_stream` (across hosts), `shm` (one-sided reads on one host), `fake` (tests).
The prefill side keeps the KV under a kv_lease (`lease.py`) until the decode side confirms.
"""
