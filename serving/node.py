"""The one skeleton of a server that runs an engine (the prefill node, the decode node, the
colocated server): its engine stepping in its own thread, its gRPC server (health, reflection,
security), its metrics, its background tasks, and the order it starts, drains and stops in.
A server adds its gRPC services and says what `num_open` and `busy` mean for it."""

from __future__ import annotations

import asyncio
import logging
import time

from engine import LLMEngine
from engine.async_engine import AsyncEngine
from kvtransfer.security import Security
from serving.grpc_server import LIVENESS, GrpcServer
from serving.metrics import EngineExporter, Metrics

log = logging.getLogger(__name__)
WATCH_S = 0.1  # how often the engine's death is looked for


class EngineServer:
    role = "engine"  # its metrics' role label

    def __init__(
        self,
        llm: LLMEngine,
        host: str,
        port: int,
        security: Security,
        metrics: Metrics | None,
        any_port_if_taken: bool = False,
    ):
        self.llm = llm  # touched only in the engine thread (engine.call, engine.stream) but for counters
        self.engine = AsyncEngine(llm)
        self.server = GrpcServer(host, port, security, any_port_if_taken)
        self.metrics = metrics or Metrics()
        self.exporter = EngineExporter(self.metrics, self.role, self.engine, self.num_open)
        self._tasks: set[asyncio.Task] = set()
        self._finishing: set[asyncio.Task] = set()
        self.dead = asyncio.Event()  # the engine's loop died: the process exits (serving/process.py)

    @property
    def address(self) -> str:
        return self.server.address

    def num_open(self) -> int:
        """Requests open here (a metric)."""
        return 0

    def busy(self) -> bool:
        """Whether work is still in flight (drain waits for it)."""
        return False

    def background(self, coro, cancel_on_stop: bool = True) -> asyncio.Task:
        """A task held until done (the loop keeps only weak references); cancelled by stop(),
        or (cancel_on_stop False: a message that should still reach its peer) left to finish."""
        tasks = self._tasks if cancel_on_stop else self._finishing
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def start(self) -> None:
        await self.server.start()
        self.background(self.exporter.run())
        self.background(self._watch_engine())

    async def _watch_engine(self) -> None:
        """An engine whose loop died (a step raised) serves nothing: health and liveness go
        NOT_SERVING at once, so routers and probes drop the node (failing fast, it would look the
        least loaded), and `dead` is set: the process exits, for `pdserve up` or Serve to restart it."""
        while self.engine.error is None:
            await asyncio.sleep(WATCH_S)
        log.error("%s engine died (%s): health NOT_SERVING", self.role, self.engine.error)
        await self.server.set_serving(False, self.server.service_names + ["", LIVENESS])
        self.dead.set()

    async def drain(self, timeout_s: float, min_s: float = 2.0) -> None:
        """Stops taking work (health NOT_SERVING) and waits until nothing is in flight, at most
        timeout_s (a scale-down loses no tokens); and at least min_s, so that routers see the
        node go before it stops answering."""
        await self.server.set_serving(False)
        started = time.time()
        while self.busy() and time.time() < started + timeout_s or time.time() < started + min_s:
            await asyncio.sleep(0.05)

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        for task in list(self._tasks):
            task.cancel()
        self.engine.stop()
