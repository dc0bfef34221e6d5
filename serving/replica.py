"""What a Prefill or Decode replica under Ray Serve does the same way: run its node's gRPC server
on its Ray node's IP, announce it in the application's registry (serving/registry.py: renewed
every few seconds, so a registry restarted on another Ray node fills again), export its
pool's gauges and counters through Ray's metrics (tagged with the replica), say it is unhealthy
when its engine died, and when Serve removes it, deregister (routers stop picking it), drain,
stop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ray import serve
from ray.util import metrics

from serving.registry import Announcement

Reading = Callable[[], float]


class Replica:
    def __init__(
        self,
        role: str,
        app_name: str,
        node,
        drain_timeout_s: float,
        gauges: dict[str, tuple[str, Reading]],
        counters: dict[str, tuple[str, Reading]] | None = None,
    ):
        """gauges, counters: metric name -> (description, read its value now; a counter's total)."""
        self.role, self.node, self.drain_timeout_s = role, node, drain_timeout_s
        self.app_name = app_name
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.announcement: Announcement | None = None
        tags = {"replica": self.replica}
        self.gauges = [
            (metrics.Gauge(name, description, tag_keys=("replica",)), read)
            for name, (description, read) in gauges.items()
        ]
        self.counters = [
            (metrics.Counter(name, description, tag_keys=("replica",)), read, [0.0])
            for name, (description, read) in (counters or {}).items()
        ]
        for metric, *_ in self.gauges + self.counters:
            metric.set_default_tags(tags)
        self._export: asyncio.Task | None = None

    async def start(self) -> None:
        await self.node.start()
        self.announcement = Announcement(self.app_name, self.role, self.replica, self.node.address)
        await self.announcement.start()
        self._export = asyncio.create_task(self._export_metrics())

    async def _export_metrics(self) -> None:
        while True:
            for gauge, read in self.gauges:
                gauge.set(read())
            for counter, read, last in self.counters:
                total = read()
                if total > last[0]:
                    counter.inc(total - last[0])
                    last[0] = total
            await asyncio.sleep(1.0)

    def check_health(self) -> None:
        if self.node.engine.error is not None:
            raise RuntimeError(f"{self.role} engine died: {self.node.engine.error}")

    async def stop(self) -> None:
        """Serve awaits this before it stops the replica (force-killed after graceful_shutdown_timeout_s)."""
        if self.announcement is not None:
            await self.announcement.stop()
        if self._export is not None:
            self._export.cancel()
        await self.node.drain(self.drain_timeout_s)
        await self.node.stop(1.0)
