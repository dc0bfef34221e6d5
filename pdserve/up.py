"""`pdserve up`: a router plus N prefill and M decode node processes on this host.

Each node is its own process (`python -m prefill_node` / `python -m decode_node`, port chosen
by the OS and announced on its READY line); the router runs in this process. Ctrl-C or SIGTERM
stops the router, then every node by its PID (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

READY_TIMEOUT_S = 600.0  # the first start converts the model
STOP_GRACE_S = 10.0


class Node:
    def __init__(self, role: str, index: int, proc: asyncio.subprocess.Process):
        self.role, self.index, self.proc = role, index, proc
        self.address = ""
        self.metrics = ""
        self._pump: asyncio.Task | None = None

    async def wait_ready(self) -> str:
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.role} node {self.index} exited (code {await self.proc.wait()}) "
                                   "before it was ready")
            text = line.decode().rstrip()
            if text.startswith("READY "):
                self.address = text.split()[1]
                self.metrics = next((w.split("=")[1] for w in text.split()[2:] if w.startswith("metrics=")), "")
                self._pump = asyncio.create_task(self._forward_output())
                return self.address
            print(f"[{self.role}-{self.index}] {text}", file=sys.stderr)

    async def _forward_output(self) -> None:
        async for line in self.proc.stdout:
            print(f"[{self.role}-{self.index}] {line.decode().rstrip()}", file=sys.stderr)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_GRACE_S)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._pump:
            self._pump.cancel()


def read_keys(path: str | None) -> tuple[str, ...]:
    return tuple(line.strip() for line in open(path) if line.strip()) if path else ()


def security_args(args) -> list[str]:
    from pdserve.cli import security_args as flags

    return flags(args)


def node_args(args, threads: int, metrics_port: int | None) -> list[str]:
    return ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--kv-cache-gb",
            str(args.kv_cache_gb), "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
            str(args.max_num_batched_tokens), "--block-size", str(args.block_size), "--num-threads", str(threads),
            *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
            *(["--metrics-port", str(metrics_port)] if metrics_port is not None else [])]


async def start_nodes(args) -> list[Node]:
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // (args.prefill + args.decode))
    nodes = []
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        module = f"{role}_node"
        for i in range(count):
            extra = ["--kv-transport", args.kv_transport] if role == "decode" else []
            # Metrics ports: the router on --metrics-port, the nodes on the ports after it.
            metrics_port = args.metrics_port + 1 + len(nodes) if args.metrics_port else None
            if args.pin_cpus:
                extra += ["--cpus", str(len(nodes) % (os.cpu_count() or 1))]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", module, "--host", args.host, "--port", "0",
                *node_args(args, threads, metrics_port), *extra, *security_args(args), stdout=asyncio.subprocess.PIPE)
            nodes.append(Node(role, i, proc))
    try:
        await asyncio.wait_for(asyncio.gather(*(n.wait_ready() for n in nodes)), READY_TIMEOUT_S)
    except BaseException:
        await asyncio.gather(*(n.stop() for n in nodes))
        raise
    return nodes


async def up(args) -> int:
    from engine.model_source import resolve_model
    from pdserve.cli import internal_security, public_security
    from router.server import Router

    resolve_model(args.model)  # convert once here, not in every node at the same time
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    nodes = await start_nodes(args)
    router = None
    try:
        router = Router(args.model, [n.address for n in nodes if n.role == "prefill"],
                        [n.address for n in nodes if n.role == "decode"], args.host, args.port, args.max_model_len,
                        public_security=public_security(args), internal_security=internal_security(args),
                        max_outstanding=args.max_outstanding, rate_limit=args.rate_limit, http_port=args.http_port,
                        api_keys=read_keys(args.api_key_file))
        await router.start()
        if router.http_address:
            print(f"pdserve up: OpenAI-compatible HTTP API on http://{router.http_address}/v1", file=sys.stderr,
                  flush=True)
        metrics = f"; metrics on ports {router.metrics.serve(args.metrics_port)}-{args.metrics_port + len(nodes)}" \
            if args.metrics_port else ""
        print(f"pdserve up: router on {router.address} serving {args.model}{metrics}; "
              f"prefill {', '.join(n.address for n in nodes if n.role == 'prefill')}; "
              f"decode {', '.join(n.address for n in nodes if n.role == 'decode')}", file=sys.stderr, flush=True)
        if args.ask:
            from pdserve.generate import stream_answer

            await asyncio.to_thread(stream_answer, router.address, args.ask, max_tokens=args.max_tokens)
            return 0
        print("Ctrl-C stops everything.", file=sys.stderr, flush=True)
        await stop.wait()
        return 0
    finally:
        if router is not None:
            await router.stop(STOP_GRACE_S)
        await asyncio.gather(*(n.stop() for n in nodes))
