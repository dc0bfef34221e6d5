"""The one way a process starts a pdserve server process (`pdserve up`, the tests' fault scenarios
and two-host runs, the benchmarks): `python -m <module> <flags>`, ready once it prints
`READY <address> [metrics=<port>]` (serving/process.py), stopped by its PID: SIGTERM, then SIGKILL
after a grace period. Blocking calls for scripts and tests; `ready()` and `exited()` await the
same from asyncio, each in a thread of its own (never the loop's shared executor, which a few
long waits would fill)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Callable


class NotReady(RuntimeError):
    """The process exited before it was ready."""

    def __init__(self, returncode: int, stderr: str = ""):
        super().__init__(f"exited with code {returncode} before it was ready{': ' + stderr if stderr else ''}")
        self.returncode = returncode


class ServerProcess:
    def __init__(self, args: list[str], *, prefix: list[str] = (), stderr=subprocess.DEVNULL, env: dict | None = None):
        """args: what follows `python`, e.g. ["-m", "prefill_node", "--port", "0"]; prefix: a
        command to run it under (e.g. `ip netns exec NS ...`); stderr: a file, DEVNULL or PIPE;
        env: variables added to this process's."""
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.address = ""
        self.metrics_port = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def wait_ready(self, on_line: Callable[[str], None] | None = None) -> str:
        """Reads its output until READY; returns its address. Other lines go to on_line. Raises
        NotReady if it exits first."""
        for line in self.proc.stdout:
            if line.startswith("READY "):
                words = line.split()
                self.address = words[1]
                self.metrics_port = next((w.split("=")[1] for w in words[2:] if w.startswith("metrics=")), "")
                return self.address
            if on_line is not None:
                on_line(line.rstrip())
        code = self.proc.wait()
        raise NotReady(code, self.proc.stderr.read()[-2000:] if self.proc.stderr else "")

    def forward_output(self, on_line: Callable[[str], None]) -> None:
        """Hands the rest of its output to on_line, line by line (a daemon thread)."""

        def pump():
            for line in self.proc.stdout:
                on_line(line.rstrip())

        threading.Thread(target=pump, daemon=True).start()

    async def ready(self, on_line: Callable[[str], None] | None = None) -> str:
        return await _in_thread(self.wait_ready, on_line)

    async def exited(self) -> int:
        """Its exit code (negative: the signal) once it exits."""
        return await _in_thread(self.proc.wait)

    def kill(self) -> None:
        """SIGKILL by PID: it dies with whatever it had in flight, as a crashed host would."""
        self.proc.kill()  # nothing if it was reaped already
        self.proc.wait()

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM (it drains and stops), then SIGKILL after grace_s; returns its exit code."""
        self.proc.terminate()  # nothing if it was reaped already
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
        return self.proc.wait()

    async def stopped(self, grace_s: float = 30.0) -> int:
        """stop(), awaited."""
        return await _in_thread(self.stop, grace_s)


def _in_thread(fn, *args) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run():
        try:
            outcome = (True, fn(*args))
        except BaseException as e:  # handed to the awaiting coroutine
            outcome = (False, e)
        try:
            loop.call_soon_threadsafe(_settle, future, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, daemon=True).start()
    return future


def _settle(future: asyncio.Future, ok: bool, value) -> None:
    if not future.done():
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
