"""The decode pool as a Ray Serve deployment: each replica runs one decode node (its own gRPC
server), announces it in the registry, and reports the decode pool's scaling signal: running
sequences and KV block utilization. Scale-down drains: open streams finish first."""

from __future__ import annotations

import asyncio

import ray
from ray import serve
from ray.util import metrics

from decode_node.server import DecodeNode
from engine import EngineConfig
from pdserve.metrics import Metrics
from pdserve.registry import preferred_port, registry


@serve.deployment(name="Decode", ray_actor_options={"num_cpus": 0})
class DecodeDeployment:
    async def __init__(self, app_name: str, engine: dict, kv_transport: str = "auto", drain_timeout_s: float = 600.0,
                       port: int = 0):
        host = ray.util.get_node_ip_address()
        self.node = DecodeNode(EngineConfig(**engine), host=host, port=preferred_port(host, port),
                               kv_transport=kv_transport, metrics=Metrics("ray"))
        await self.node.start()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.drain_timeout_s = drain_timeout_s
        self.registry = registry(app_name)
        await self.registry.register.remote("decode", self.replica, self.node.address)
        tags = {"replica": self.replica}
        self.gauges = {name: metrics.Gauge(f"pdserve_decode_{name}", description, tag_keys=("replica",))
                       for name, description in [("running_sequences", "Sequences transferring or decoding"),
                                                 ("kv_utilization", "Used KV blocks / all KV blocks"),
                                                 ("tokens_per_second", "Generated tokens per second")]}
        for g in self.gauges.values():
            g.set_default_tags(tags)
        self._metrics = asyncio.create_task(self._export_metrics())

    def _kv_utilization(self) -> float:
        bm = self.node.engine.engine.block_manager
        return bm.num_used_blocks / bm.num_blocks

    async def _export_metrics(self) -> None:
        engine = self.node.engine.engine
        last = engine.num_generated_tokens
        while True:
            await asyncio.sleep(1.0)
            self.gauges["running_sequences"].set(self.node.num_active)
            self.gauges["kv_utilization"].set(self._kv_utilization())
            self.gauges["tokens_per_second"].set(engine.num_generated_tokens - last)
            last = engine.num_generated_tokens

    async def address(self) -> str:
        return self.node.address

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {"running_sequences": float(self.node.num_active), "kv_utilization": self._kv_utilization()}

    async def check_health(self) -> None:
        if self.node.engine.error is not None:
            raise RuntimeError(f"decode engine died: {self.node.engine.error}")

    async def __del__(self):
        # Serve awaits this before it stops the replica: deregister (the router stops picking this
        # node), then let every open stream finish, then stop.
        await self.registry.deregister.remote("decode", self.replica)
        self._metrics.cancel()
        await self.node.drain(self.drain_timeout_s)
        await self.node.stop(1.0)
