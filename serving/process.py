"""A server process's entry point (`python -m router | prefill_node | decode_node`): its command
line from its config classes, then the server run until SIGTERM/SIGINT, announcing readiness on
stdout (`READY <address>`, what serving/launcher.py waits for)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from engine import EngineConfig
from engine.config import option
from kvtransfer.security import SecurityConfig
from serving.options import HelpFormatter, add_options, from_args

log = logging.getLogger(__name__)
PARENT_ENV = "PDSERVE_PARENT_PID"  # set by `pdserve up`: its nodes exit when it is gone


@dataclass(frozen=True)
class ProcessConfig:
    """A server process's own options."""

    host: str = option("127.0.0.1", "the interface to listen on", where=("cli",))
    metrics_port: int | None = option(
        None, "serve Prometheus /metrics here (0: any port) (default: no metrics server)", where=("cli",)
    )
    cpus: str | None = option(
        None,
        "pin the process, and the processes it starts, to these cores, e.g. 0 or 0-1 (default: not pinned)",
        where=("cli",),
    )


@dataclass(frozen=True)
class Entry:
    """A server process's entry point: its command line (ProcessConfig's options, then what
    add_args adds) and build(args), its server."""

    prog: str
    describe: str
    add_args: Callable[[argparse.ArgumentParser], None]
    build: Callable[[argparse.Namespace], object]

    def parser(self) -> argparse.ArgumentParser:
        ap = argparse.ArgumentParser(prog=self.prog, description=self.describe, formatter_class=HelpFormatter)
        add_options(ap, ProcessConfig)
        self.add_args(ap)
        return ap

    def main(self, argv: list[str] | None = None) -> None:
        """Parses the command line, pins the cores, and runs the server (built inside the event
        loop, which grpc.aio needs; a config it refuses is a ValueError there) until a signal."""
        ap = self.parser()
        args = ap.parse_args(argv)
        setup_logging()
        try:
            pin_cpus(args.cpus)
        except ValueError as e:
            ap.error(str(e))
        asyncio.run(run_until_signalled(lambda: self.build(args), metrics_port=args.metrics_port))


def node_entry(prog: str, describe: str, config_cls: type, kv_option_classes: list[type], node_cls: type) -> Entry:
    """A node's entry point: its own options (config_cls), its KV transports' (kvtransfer/), the
    engine's and the internal ports' security; its server is node_cls(**node_configs(...))."""
    return Entry(
        prog,
        describe,
        lambda ap: add_options(ap, config_cls, *kv_option_classes, EngineConfig, SecurityConfig),
        lambda args: node_cls(**node_configs(args, config_cls, kv_option_classes)),
    )


def node_configs(args: argparse.Namespace, config_cls: type, kv_option_classes: list[type]) -> dict:
    """A node's constructor arguments, from its parsed command line."""
    return {
        "engine_config": from_args(EngineConfig, args),
        "config": from_args(config_cls, args),
        "host": args.host,
        "security": from_args(SecurityConfig, args).security(),
        "kv_options": tuple(from_args(cls, args) for cls in kv_option_classes),
    }


async def run_until_signalled(make_node, grace_s: float = 30.0, metrics_port: int | None = None) -> None:
    """Builds a node with make_node() (inside the event loop, which grpc.aio servers need), starts it
    (anything with start/stop/address/metrics), serves its Prometheus metrics on metrics_port (if
    given; 0 picks one), prints 'READY <address> [metrics=<port>]' once it serves, and stops it
    gracefully on SIGTERM or SIGINT. If its engine dies (node.dead) it stops and exits with status 1."""
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
    dead = getattr(node, "dead", None)  # an engine server's engine died
    waits = [asyncio.create_task(e.wait()) for e in (stop, dead) if e is not None]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in [watch, *waits]:
        if task:
            task.cancel()
    if dead is not None and dead.is_set():
        log.error("the engine died: exiting with status 1, to be restarted")
        await node.stop(1.0)
        raise SystemExit(1)
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


def usable_cores() -> list[int]:
    """The cores this process may use (--cpus pinned it to them; macOS has no affinity: all)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def pin_cpus(spec: str | None) -> None:
    """Restricts this process (and the processes it starts) to the given cores ('0', '0,1',
    '2-3'); None leaves it free. A spec that names no core of this machine is a ValueError."""
    if not spec:
        return
    cores = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, cores)
    except (ValueError, OSError):
        raise ValueError(
            f"--cpus {spec!r}: not cores of this machine (e.g. 0 or 0-1; it has {os.cpu_count()})"
        ) from None
