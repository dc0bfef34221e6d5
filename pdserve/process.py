"""Running a server process until SIGTERM/SIGINT, announcing readiness on stdout."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

log = logging.getLogger(__name__)
PARENT_ENV = "PDSERVE_PARENT_PID"  # set by `pdserve up`: its nodes exit when it is gone


async def run_until_signalled(make_node, grace_s: float = 30.0, metrics_port: int | None = None) -> None:
    """Builds a node with make_node() (inside the event loop, which grpc.aio servers need), starts it
    (anything with start/stop/address/metrics), serves its Prometheus metrics on metrics_port (if
    given; 0 picks one), prints 'READY <address> [metrics=<port>]' once it serves, and stops it
    gracefully on SIGTERM or SIGINT."""
    node = make_node()
    await node.start()
    extra = f" metrics={node.metrics.serve(metrics_port)}" if metrics_port is not None else ""
    print(f"READY {node.address}{extra}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.environ.pop(PARENT_ENV, None)
    watch = asyncio.create_task(_stop_when_gone(int(parent), stop)) if parent else None
    await stop.wait()
    if watch:
        watch.cancel()
    if hasattr(node, "drain"):  # finish what is in flight first
        await node.drain(grace_s)
    await node.stop(grace_s)


async def _stop_when_gone(parent: int, stop: asyncio.Event) -> None:
    """A node `pdserve up` started stops when up is gone (killed with SIGKILL, it cannot stop its
    nodes): orphans would hold their ports, cores and KV memory with nobody to route to them."""
    while os.getppid() == parent:
        await asyncio.sleep(1)
    log.warning("pdserve up (pid %d) is gone: stopping", parent)
    stop.set()


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def pin_cpus(spec: str | None) -> None:
    """Restricts this process (and the processes it starts) to the given cores ('0', '0,1',
    '2-3'); None leaves it free. A spec that names no core of this machine is a ValueError."""
    if not spec:
        return
    import os

    cores = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, cores)
    except (ValueError, OSError):
        raise ValueError(f"--cpus {spec!r}: not cores of this machine (e.g. 0 or 0-1; it has "
                         f"{os.cpu_count()})") from None
