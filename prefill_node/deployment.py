"""The prefill pool as a Ray Serve deployment: each replica runs one prefill node (its own gRPC
server on its Ray node's IP), announces it in the registry, and reports the prefill pool's
scaling signal: prompt tokens and requests waiting for a prefill."""

from __future__ import annotations

import asyncio

import ray
from ray import serve
from ray.util import metrics

from engine import EngineConfig
from pdserve.metrics import Metrics
from pdserve.registry import preferred_port, registry
from prefill_node.server import PrefillNode


@serve.deployment(name="Prefill", ray_actor_options={"num_cpus": 0})
class PrefillDeployment:
    async def __init__(self, app_name: str, engine: dict, lease_ttl_s: float = 30.0, shm: bool = True,
                       drain_timeout_s: float = 60.0, port: int = 0):
        host = ray.util.get_node_ip_address()
        self.node = PrefillNode(EngineConfig(**engine), host=host, port=preferred_port(host, port),
                                lease_ttl_s=lease_ttl_s, shm=shm, metrics=Metrics("ray"))
        await self.node.start()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.drain_timeout_s = drain_timeout_s
        self.registry = registry(app_name)
        await self.registry.register.remote("prefill", self.replica, self.node.address)
        tags = {"replica": self.replica}
        self.gauges = {name: metrics.Gauge(f"pdserve_prefill_{name}", description, tag_keys=("replica",))
                       for name, description in [("pending_requests", "Prefill calls waiting or running"),
                                                 ("pending_tokens", "Prompt tokens of those calls"),
                                                 ("kv_leases", "Prefilled KV waiting to be read")]}
        for g in self.gauges.values():
            g.set_default_tags(tags)
        self.prefills = metrics.Counter("pdserve_prefill_requests_total", "Prefills answered",
                                        tag_keys=("replica",))
        self.prefills.set_default_tags(tags)
        self._last_count = 0
        self._metrics = asyncio.create_task(self._export_metrics())

    async def _export_metrics(self) -> None:
        while True:
            self.gauges["pending_requests"].set(self.node.num_pending)
            self.gauges["pending_tokens"].set(self.node.pending_tokens)
            self.gauges["kv_leases"].set(len(self.node.leases))
            if self.node.num_prefilled > self._last_count:
                self.prefills.inc(self.node.num_prefilled - self._last_count)
                self._last_count = self.node.num_prefilled
            await asyncio.sleep(1.0)

    async def address(self) -> str:
        return self.node.address

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {"pending_tokens": float(self.node.pending_tokens), "pending_requests": float(self.node.num_pending)}

    async def check_health(self) -> None:
        if self.node.engine.error is not None:
            raise RuntimeError(f"prefill engine died: {self.node.engine.error}")

    async def __del__(self):
        # Serve awaits this before it stops the replica (force-killed after graceful_shutdown_timeout_s).
        await self.registry.deregister.remote("prefill", self.replica)
        self._metrics.cancel()
        await self.node.drain(self.drain_timeout_s)
        await self.node.stop(1.0)
