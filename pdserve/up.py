"""`pdserve up`: a router plus N prefill and M decode node processes on this host.

Each node is its own process (`python -m prefill_node` / `python -m decode_node`, port chosen
by the OS and announced on its READY line; its stderr, where it logs, goes to
`<log dir>/<role>-<index>.log`); the router runs in this process. Fixed ports (--port,
--http-port, --metrics-port) are checked before any node starts. One line says what starts and
where the logs go, one line per node as it becomes ready (role, address, PID, time, log), then
the router's. A temporary log directory (no --log-dir) is removed at exit unless a node failed.

A node that exits before the cluster is up stops everything: `pdserve up` prints one line naming
the node (role, index, PID, exit code) with the error line of its log (e.g. `ValueError: ...`,
not the traceback, which stays in the log), stops the others by PID and exits 1. A node that exits
while serving is restarted: one line says so, the router stops sending it work (its in-flight
requests migrate to the other nodes), the other nodes keep serving, and after a backoff (1, 2,
4, ... 30 s) a new process takes its place (same role, index and log, appended) and joins the
router when ready. A crash loop gives up: a node's `--node-restarts`+1-th exit within 5 minutes
stops everything and exits 1 (`--node-restarts 0`: the first exit does).

Ctrl-C or SIGTERM stops the router, then every node by its PID (SIGTERM, then SIGKILL after a
grace period).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from decode_node.config import DecodeConfig
from engine import EngineConfig
from engine.config import option
from kvtransfer import transports
from kvtransfer.security import SecurityConfig
from prefill_node.config import PrefillConfig
from router.config import RouterConfig
from serving.launcher import NotReady, ServerProcess
from serving.options import add_options, from_args, options, to_argv
from serving.process import PARENT_ENV, ProcessConfig, usable_cores

READY_TIMEOUT_S = 600.0  # the first start converts the model
STOP_GRACE_S = 10.0
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # before a node's restart, by its exits in the window
CRASH_WINDOW_S = 300.0  # exits of one node counted towards --node-restarts
# The last line of a Python traceback: "ValueError: ...", "torch.OutOfMemoryError: ...".
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")
# Each node kind's options, forwarded to its processes (their own port and threads are up's to set).
NODE_OPTIONS = {
    "prefill": (PrefillConfig, *transports.sender_options()),
    "decode": (DecodeConfig, *transports.reader_options()),
}
NODE_THREADS = "num_threads"  # up gives each node its share of the cores (or the value given)


@dataclass(frozen=True)
class UpConfig:
    prefill: int = option(1, "prefill node processes")
    decode: int = option(1, "decode node processes")
    ask: str | None = option(
        None, "ask this question once the cluster is up, stream the answer, then stop (default: serve until Ctrl-C)"
    )
    max_tokens: int = option(256, "with --ask")
    node_restarts: int = option(
        5,
        "a node that exits while serving is restarted, at most this many times in 5 "
        "minutes; one more exit stops everything (0: the first exit does)",
    )
    pin_cpus: bool = option(False, "give each node process its own core (round robin over --cpus, or all cores)")
    pin_gpus: bool = option(
        False,
        "give each node process its own GPU (round robin over the visible GPUs, through its "
        "CUDA_VISIBLE_DEVICES; with --device cuda)",
    )
    log_dir: str | None = option(
        None,
        "each node's log (its stderr) goes to <role>-<index>.log here (default: a new "
        "temporary directory, printed at start)",
    )

    def __post_init__(self):
        for name, least in (("prefill", 0), ("decode", 1), ("max_tokens", 1), ("node_restarts", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")


# What these options mean to up, where that says more than the component's own help.
HELPS = {
    "host": "the interface every process listens on",
    "metrics_port": "Prometheus /metrics: the router on this port, the nodes on the next ones",
    "num_threads": "torch threads per node (default: the cores divided among the node processes)",
    "max_model_len": "longest prompt + output in tokens, at the router and in every engine (default: the model's "
    "context length)",
}


def add_args(p) -> None:
    """up's own options, the router's, every node kind's but those each node process has its own
    value of (a port: up picks them), the engine's and security's."""
    node_classes = (*NODE_OPTIONS["prefill"], *NODE_OPTIONS["decode"])
    add_options(p, UpConfig, ProcessConfig, RouterConfig, helps=HELPS)
    add_options(p, *node_classes, skip={o.name for cls in node_classes for o in options(cls, "cli") if o.per_process})
    add_options(p, EngineConfig, SecurityConfig, helps=HELPS)


class NodeFailed(RuntimeError):
    """A node process exited or never became ready; the message is one line saying why."""


class Node:
    def __init__(self, role: str, index: int, process: ServerProcess, log: Path):
        self.role, self.index, self.process, self.log = role, index, process, log
        self.started = time.monotonic()

    def __str__(self) -> str:
        address = self.process.address
        return f"{self.role} node {self.index} (pid {self.process.pid}{', ' + address if address else ''})"

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def wait_ready(self) -> str:
        try:
            address = await self.process.ready(on_line=self._print)
        except NotReady as e:
            raise NodeFailed(self.exit_message(e.returncode, "before it was ready")) from None
        self.process.forward_output(self._print)
        print(
            f"pdserve up: {self.role} node {self.index} on {address}, pid {self.process.pid}, "
            f"ready in {time.monotonic() - self.started:.1f} s, log {self.log}",
            file=sys.stderr,
            flush=True,
        )
        return address

    def _print(self, line: str) -> None:
        print(f"[{self.role}-{self.index}] {line}", file=sys.stderr)

    def exit_message(self, code: int, when: str = "") -> str:
        """One line: which node, its exit code (or signal), the error line of its log, the log."""
        how = f"code {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else "")
        error = last_error(self.log)
        return f"{self} exited with {how}{' ' + when if when else ''}{': ' + error if error else ''} (log: {self.log})"

    async def stop(self) -> None:
        await self.process.stopped(STOP_GRACE_S)


def last_error(log: Path, tail_bytes: int = 65536) -> str:
    """The last line of a node's log that states an exception ("" if none: e.g. it was killed)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if ERROR_LINE.match(line)), "")


async def keep_running(nodes: list[Node], i: int, spawner: Spawner, restarts: int, on_change) -> str:
    """Restarts nodes[i] whenever it exits, after a backoff; `on_change()` after each exit and each
    restart's ready (the router follows). Returns the line that gives up: its restarts+1-th exit
    within CRASH_WINDOW_S."""
    exits: list[float] = []
    while True:
        node = nodes[i]
        code = await node.process.exited()
        now = time.monotonic()
        exits = [t for t in exits if now - t < CRASH_WINDOW_S] + [now]
        if len(exits) > restarts:
            return (
                f"{node.exit_message(code)}; {len(exits)} exit{'s' if len(exits) > 1 else ''} in "
                f"{CRASH_WINDOW_S:.0f} s (--node-restarts {restarts}): stopping the others"
            )
        delay = RESTART_BACKOFF_S[min(len(exits), len(RESTART_BACKOFF_S)) - 1]
        print(
            f"pdserve up: {node.exit_message(code)}; the other nodes keep serving, restarting it in {delay:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        await on_change()
        await asyncio.sleep(delay)
        spawner.num_restarts += 1
        nodes[i] = spawner.spawn(node.role, node.index, restart=True)
        try:
            await asyncio.wait_for(nodes[i].wait_ready(), READY_TIMEOUT_S)
        except NodeFailed:
            continue  # it exited: counted above
        except TimeoutError:
            await nodes[i].process.stopped(0)  # not ready in time: killed, counted as an exit
            continue
        await on_change()


def check_ports(args) -> None:
    """Raises OSError, in one line naming the flag, for a fixed port that cannot be bound: before
    any node starts, not after (gRPC would only fail once the nodes were up, and log a C++ line)."""
    wanted = [("--port", args.host, args.port), ("--http-port", args.host, args.http_port)]
    if args.metrics_port:  # the router on it, the nodes on the ports after it (all interfaces)
        wanted += [("--metrics-port", "0.0.0.0", args.metrics_port + i) for i in range(args.prefill + args.decode + 1)]
    seen = {}
    for flag, host, port in wanted:
        if not port:
            continue
        if port in seen:
            raise OSError(f"{seen[port]} and {flag} both need port {port}")
        seen[port] = flag
        try:
            socket.create_server((host, port)).close()  # SO_REUSEADDR, as gRPC and uvicorn bind
        except OSError as e:
            raise OSError(f"could not bind {host}:{port} ({flag}): {os.strerror(e.errno) if e.errno else e}") from None


class Spawner:
    """Starts node processes as `pdserve up` was told to (each node's own port, cores and log)."""

    def __init__(self, args, log_dir: Path):
        self.args, self.log_dir = args, log_dir
        self.cores = usable_cores()
        self.threads = args.num_threads or max(1, len(self.cores) // (args.prefill + args.decode))
        self.slots = [
            (role, i) for role, count in (("prefill", args.prefill), ("decode", args.decode)) for i in range(count)
        ]
        self.gpus = visible_gpus() if args.pin_gpus else []  # check_options: some when asked
        self.num_restarts = 0  # a temporary log dir is kept when a node had to be restarted

    def argv(self, role: str, index: int) -> list[str]:
        """The node's command line: up's engine, security and node-kind options as given, its own
        port, threads, metrics port (the router on --metrics-port, the nodes after it) and core."""
        args, slot = self.args, self.slots.index((role, index))
        own = ["--host", args.host, "--port", "0", "--num-threads", str(self.threads)]
        if args.metrics_port:
            own += ["--metrics-port", str(args.metrics_port + 1 + slot)]
        if args.pin_cpus:
            own += ["--cpus", str(self.cores[slot % len(self.cores)])]
        return [
            "-m",
            f"{role}_node",
            *own,
            *to_argv(args, *NODE_OPTIONS[role], EngineConfig, SecurityConfig, skip=(NODE_THREADS,)),
        ]

    def env(self, role: str, index: int) -> dict[str, str]:
        """What the node's environment adds: its parent's PID, and its own GPU with --pin-gpus."""
        env = {PARENT_ENV: str(os.getpid())}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[self.slots.index((role, index)) % len(self.gpus)]
        return env

    def spawn(self, role: str, index: int, restart: bool = False) -> Node:
        log = self.log_dir / f"{role}-{index}.log"
        mode = os.O_APPEND if restart else os.O_TRUNC  # a restart keeps the crash's log above its own
        with open(os.open(log, os.O_WRONLY | os.O_CREAT | mode, 0o600), "ab") as stderr:  # the child keeps its own
            process = ServerProcess(self.argv(role, index), stderr=stderr, env=self.env(role, index))
        return Node(role, index, process, log)


async def start_nodes(spawner: Spawner, stop: asyncio.Event) -> list[Node]:
    """Starts every node and waits until all are ready; [] if `stop` is set first. Raises
    NodeFailed (having stopped the others) when one exits, or is not ready in time."""
    nodes = [spawner.spawn(role, i) for role, i in spawner.slots]
    ready = [asyncio.ensure_future(n.wait_ready()) for n in nodes]
    all_ready = asyncio.gather(*ready)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([all_ready, stopped], timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        if all_ready in done:
            all_ready.result()  # raises the first node's NodeFailed
            return nodes
        if stopped not in done:
            late = ", ".join(str(n) for n, t in zip(nodes, ready) if not t.done())
            raise NodeFailed(f"{late} not ready after {READY_TIMEOUT_S:.0f} s (logs in {spawner.log_dir})")
    except BaseException:
        await asyncio.gather(*(n.stop() for n in nodes))
        raise
    finally:
        for t in [*ready, stopped]:
            t.cancel()
    await asyncio.gather(*(n.stop() for n in nodes))  # Ctrl-C while starting
    return []


def visible_gpus() -> list[str]:
    """The GPUs this process may give its nodes: CUDA_VISIBLE_DEVICES's entries where it is set,
    else every GPU torch sees."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        gpus = []
        for g in (g.strip() for g in listed.split(",")):
            if not g or g.startswith("-"):
                break  # CUDA ignores the entries after an invalid one
            gpus.append(g)
        return gpus
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def check_options(args) -> None:
    """Every option as its config checks it, before anything starts (a ValueError names the
    field); the security files are read (an OSError names a missing one)."""
    for cls in (UpConfig, RouterConfig, *NODE_OPTIONS["prefill"], *NODE_OPTIONS["decode"], EngineConfig):
        from_args(cls, args)
    from_args(SecurityConfig, args).security()
    from_args(RouterConfig, args).public_security()
    if args.pin_gpus and args.device not in ("cuda", "cuda:0"):
        raise ValueError(f"--pin-gpus needs --device cuda (each node sees its own GPU as cuda:0), got {args.device}")
    if args.pin_gpus and not visible_gpus():
        raise ValueError("--pin-gpus: no GPU is visible here (CUDA_VISIBLE_DEVICES, torch.cuda)")


async def up(args) -> int:
    from engine.model_source import resolve_model

    check_options(args)
    check_ports(args)
    temporary = not args.log_dir
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-")) if temporary else Path(args.log_dir)
    log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    print(
        f"pdserve up: model {args.model}: starting {args.prefill} prefill + {args.decode} decode node "
        f"processes, logs in {log_dir}{' (removed at exit unless a node fails)' if temporary else ''}",
        file=sys.stderr,
        flush=True,
    )
    failed = True
    spawner = Spawner(args, log_dir)
    try:
        resolve_model(args.model)  # convert once here, not in every node at the same time
        failed = await serve(args, spawner) != 0
        return 0 if not failed else 1
    finally:
        if temporary and not failed and not spawner.num_restarts:
            shutil.rmtree(log_dir, ignore_errors=True)  # kept otherwise: a failed node's line names its log


async def serve(args, spawner: Spawner) -> int:
    """The nodes, then the router; until Ctrl-C, SIGTERM, the --ask answer or a node's exit."""
    from router.server import Router

    began = time.monotonic()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    nodes = await start_nodes(spawner, stop)
    if not nodes:
        return 0
    router = None
    supervisors: list[asyncio.Task] = []
    try:
        config = from_args(RouterConfig, args)
        router = Router(
            args.model,
            [n.process.address for n in nodes if n.role == "prefill"],
            [n.process.address for n in nodes if n.role == "decode"],
            config,
            host=args.host,
            internal_security=from_args(SecurityConfig, args).security(),
        )
        await router.start()
        if router.http_address:
            print(f"pdserve up: OpenAI-compatible HTTP API on http://{router.http_address}/v1", file=sys.stderr)
        metrics = (
            f"; metrics on ports {router.metrics.serve(args.metrics_port)}-{args.metrics_port + len(nodes)}"
            if args.metrics_port
            else ""
        )
        print(
            f"pdserve up: router on {router.address} serving {args.model}{metrics}, pid {os.getpid()}, "
            f"up in {time.monotonic() - began:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        work = asyncio.ensure_future(ask(args, router) if args.ask else stop.wait())
        if not args.ask:
            print("Ctrl-C stops everything.", file=sys.stderr, flush=True)

        async def follow_nodes() -> None:  # the router's pools: the nodes alive and ready now
            for role, pool in (("prefill", router.prefill_pool), ("decode", router.decode_pool)):
                await pool.update(
                    [n.process.address for n in nodes if n.role == role and n.process.address and n.alive]
                )

        supervisors = [
            asyncio.ensure_future(keep_running(nodes, i, spawner, args.node_restarts, follow_nodes))
            for i in range(len(nodes))
        ]
        done, _ = await asyncio.wait([work, *supervisors], return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            print(f"pdserve up: {done.pop().result()}", file=sys.stderr, flush=True)
            return 1
        work.result()  # the answer's error, if any
        return 0
    finally:
        for task in supervisors:
            task.cancel()
        await asyncio.gather(*supervisors, return_exceptions=True)
        if router is not None:
            await router.stop(STOP_GRACE_S)
        await asyncio.gather(*(n.stop() for n in nodes))


async def ask(args, router) -> None:
    """--ask: the question through the router, as a client (with the router's first API key)."""
    from kvtransfer.security import Security
    from pdserve.generate import stream_answer

    key = Security(token=router.api_keys[0]) if router.api_keys else Security()
    await asyncio.to_thread(stream_answer, router.address, args.ask, max_tokens=args.max_tokens, security=key)
