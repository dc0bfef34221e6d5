"""The decode pool as a Ray Serve deployment: each replica runs one decode node (its own gRPC
server, serving/replica.py) and reports the decode pool's scaling signal: running sequences and
KV block utilization. Scale-down drains: open streams finish first."""

from __future__ import annotations

import ray
from ray import serve

from decode_node.config import DecodeConfig
from decode_node.server import DecodeNode
from engine import EngineConfig
from kvtransfer.security import SecurityConfig
from serving.metrics import Metrics
from serving.rates import Rates
from serving.replica import Replica


@serve.deployment(name="Decode", ray_actor_options={"num_cpus": 0})
class DecodeDeployment:
    async def __init__(
        self,
        app_name: str,
        engine: EngineConfig,
        config: DecodeConfig,
        kv_options: tuple = (),
        security: SecurityConfig = SecurityConfig(),
    ):
        host = ray.util.get_node_ip_address()
        self.node = node = DecodeNode(
            engine,
            config,
            host=host,
            metrics=Metrics("ray"),
            security=security.security(),
            kv_options=kv_options,
            any_port_if_taken=True,
        )
        self._tokens = [node.llm.num_generated_tokens]  # at the last reading of tokens_per_second
        self.replica = Replica(
            "decode",
            app_name,
            node,
            config.drain_timeout_s,
            gauges={
                "pdserve_decode_running_sequences": ("Sequences transferring or decoding", lambda: node.num_active),
                "pdserve_decode_kv_utilization": ("Used KV blocks / all KV blocks", self._kv_utilization),
                "pdserve_decode_tokens_per_second": ("Generated tokens per second", self._tokens_per_second),
            },
        )
        self.rates = Rates(
            {
                "requests": lambda: node.num_requests,
                "local_prefills": lambda: node.num_local_prefills,
                "local_new_tokens": lambda: node.local_new_tokens,
                "local_cached_tokens": lambda: node.local_cached_tokens,
                "generated_tokens": lambda: node.llm.num_generated_tokens,
            }
        )
        await self.replica.start()

    def _kv_utilization(self) -> float:
        load = self.node.llm.load()
        return 1 - load["num_free_blocks"] / load["num_total_blocks"]

    def _tokens_per_second(self) -> float:  # read once a second
        now = self.node.llm.num_generated_tokens
        rate, self._tokens[0] = now - self._tokens[0], now
        return rate

    async def address(self) -> str:
        return self.node.address

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The threshold policy's signals (running sequences, KV utilization) and the planner's:
        KV tokens held; requests, local prefills and their tokens, generated tokens, per second."""
        load = self.node.llm.load()
        used = load["num_total_blocks"] - load["num_free_blocks"]
        held = {
            "running_sequences": float(self.node.num_active),
            "kv_utilization": used / load["num_total_blocks"],
            "kv_tokens": float(used * load["block_size"]),
        }
        return held | self.rates.read()

    async def check_health(self) -> None:
        self.replica.check_health()

    async def __del__(self):
        await self.replica.stop()
