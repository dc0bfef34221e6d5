"""The prefill pool as a Ray Serve deployment: each replica runs one prefill node (its own gRPC
server on its Ray node's IP, serving/replica.py) and reports the prefill pool's scaling signal:
prompt tokens and requests waiting for a prefill."""

from __future__ import annotations

import ray
from ray import serve

from engine import EngineConfig
from kvtransfer.security import SecurityConfig
from prefill_node.config import PrefillConfig
from prefill_node.server import PrefillNode
from serving.metrics import Metrics
from serving.rates import Rates
from serving.replica import Replica


@serve.deployment(name="Prefill", ray_actor_options={"num_cpus": 0})
class PrefillDeployment:
    async def __init__(
        self,
        app_name: str,
        engine: EngineConfig,
        config: PrefillConfig,
        kv_options: tuple = (),
        security: SecurityConfig = SecurityConfig(),
    ):
        host = ray.util.get_node_ip_address()
        self.node = node = PrefillNode(
            engine,
            config,
            host=host,
            metrics=Metrics("ray"),
            security=security.security(),
            kv_options=kv_options,
            any_port_if_taken=True,
        )
        self.replica = Replica(
            "prefill",
            app_name,
            node,
            config.drain_timeout_s,
            gauges={
                "pdserve_prefill_pending_requests": ("Prefill calls waiting or running", lambda: node.num_pending),
                "pdserve_prefill_pending_tokens": ("Prompt tokens of those calls", lambda: node.pending_tokens),
                "pdserve_prefill_kv_leases": ("Prefilled KV waiting to be read", lambda: len(node.leases)),
            },
            counters={"pdserve_prefill_requests_total": ("Prefills answered", lambda: node.num_prefilled)},
        )
        cache = node.llm.block_manager  # totals read unlocked: a reading torn between the engine's
        # two updates (query, then hit tokens) is made up by the next one
        self.rates = Rates(
            {
                "prefills": lambda: node.num_prefilled,
                "cached_tokens": lambda: cache.num_hit_tokens,
                "new_tokens": lambda: cache.num_query_tokens - cache.num_hit_tokens,
            }
        )
        await self.replica.start()

    async def address(self) -> str:
        return self.node.address

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The threshold policy's signals (pending tokens and requests) and the planner's: prefills,
        and the prompt tokens they computed and found cached, per second (pdserve/autoscaling.py)."""
        pending = {"pending_tokens": float(self.node.pending_tokens), "pending_requests": float(self.node.num_pending)}
        return pending | self.rates.read()

    async def check_health(self) -> None:
        self.replica.check_health()

    async def __del__(self):
        await self.replica.stop()
