"""Where the application's replicas announce their gRPC addresses on a Ray cluster.

A small named Ray actor per application: node replicas (and the routers, for clients that want a
router's own port) register when they serve, again every HEARTBEAT_S, and deregister when they
start draining; routers poll it. Addresses are the replicas' own (node IP, port), so the KV and
the token streams go replica to replica, never through Ray's object store.

Across Ray nodes a replica can vanish without deregistering (its host lost) and the registry
itself can be restarted on another node (it lived on the host that went): an entry not renewed
for EXPIRE_S is dropped, and a restarted registry says it has not `settled` until every live
replica has had time to renew, so that a router never takes its empty first view for "no nodes".
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

log = logging.getLogger(__name__)

ROLES = ("router", "prefill", "decode")
VERSION = 2  # in the actor's name: an application upgraded in place gets a registry of this shape
CALL_TIMEOUT_S = 30.0  # a call to a registry that is restarting elsewhere waits at most this
HEARTBEAT_S = 2.0
EXPIRE_S = 30.0  # 15 missed heartbeats: a busy replica is never dropped, a lost one within 30 s
SETTLE_S = 3 * HEARTBEAT_S


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Registry:
    def __init__(self):
        self.born = time.monotonic()
        self.nodes: dict[str, dict[str, tuple[str, float]]] = {role: {} for role in ROLES}

    def register(self, role: str, replica: str, address: str) -> None:
        self.nodes[role][replica] = (address, time.monotonic())

    def deregister(self, role: str, replica: str) -> None:
        self.nodes[role].pop(replica, None)

    def snapshot(self) -> dict:
        """{"settled": bool, role: [address, ...] for each role}."""
        now = time.monotonic()
        for by_replica in self.nodes.values():
            for replica in [r for r, (_, seen) in by_replica.items() if now - seen > EXPIRE_S]:
                del by_replica[replica]
        view = {
            role: sorted({address for address, _ in by_replica.values()}) for role, by_replica in self.nodes.items()
        }
        return {"settled": now - self.born >= SETTLE_S, **view}


def registry(app_name: str):
    """The application's registry actor, created on first use (detached: it outlives replicas)."""
    return Registry.options(
        name=f"pdserve-registry-v{VERSION}-{app_name}", namespace="pdserve", get_if_exists=True, lifetime="detached"
    ).remote()


class Announcement:
    """One replica's entry, kept alive: registered at start(), renewed every HEARTBEAT_S (which
    also fills a registry restarted elsewhere), removed at stop()."""

    def __init__(self, app_name: str, role: str, replica: str, address: str):
        self.registry, self.key, self.address = registry(app_name), (role, replica), address
        self._beat: asyncio.Task | None = None

    async def start(self) -> None:
        """Registers (the heartbeat registers again if the registry cannot answer now)."""
        try:
            await asyncio.wait_for(self.registry.register.remote(*self.key, self.address), CALL_TIMEOUT_S)
        except Exception as e:
            log.warning("registering %s failed: %s; the heartbeat retries", self.key, e)
        self._beat = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self.registry.register.remote(*self.key, self.address)
            except Exception as e:  # the registry is restarting: the next beat registers again
                log.warning("registry heartbeat of %s failed: %s", self.key, e)

    async def stop(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
        try:
            await asyncio.wait_for(self.registry.deregister.remote(*self.key), CALL_TIMEOUT_S / 3)
        except Exception as e:  # the entry expires instead
            log.warning("deregistering %s failed: %s", self.key, e)
