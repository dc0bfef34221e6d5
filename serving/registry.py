"""Where the pools' replicas announce their gRPC addresses on a Ray cluster.

A small named Ray actor per application: node replicas register when they serve and deregister
when they start draining; routers poll it. Addresses are the replicas' own (node IP, port), so
the KV and the token streams go replica to replica, never through Ray's object store.
"""

from __future__ import annotations

import socket

import ray


@ray.remote(num_cpus=0, max_restarts=-1)
class Registry:
    def __init__(self):
        self.nodes: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}

    def register(self, role: str, replica: str, address: str) -> None:
        self.nodes[role][replica] = address

    def deregister(self, role: str, replica: str) -> None:
        self.nodes[role].pop(replica, None)

    def snapshot(self) -> dict[str, list[str]]:
        return {role: sorted(by_replica.values()) for role, by_replica in self.nodes.items()}


def registry(app_name: str):
    """The application's registry actor, created on first use (detached: it outlives replicas)."""
    return Registry.options(
        name=f"pdserve-registry-{app_name}", namespace="pdserve", get_if_exists=True, lifetime="detached"
    ).remote()


def preferred_port(host: str, port: int) -> int:
    """`port` if it is free on host, else 0 (any): on Kubernetes each replica has its pod and its
    fixed port (probes use it); on one machine a second replica takes another."""
    if port == 0:
        return 0
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return 0
    return port
