"""An LLMEngine stepping in its own thread, for asyncio servers.

The engine is single-threaded by design. Its thread runs commands (add, abort, reserve blocks,
release a lease...) between steps and then steps; asyncio callers submit commands and await
their results, and stream a request's outputs from a queue the thread fills. Nothing here knows
about gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  # a step that ran nothing: wait this long, or until a command comes


class EngineDead(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None
        self.on_step: Callable[[float], None] | None = None  # called with each step's seconds
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- asyncio side -------------------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Runs fn(*args) in the engine thread between two steps; returns or raises its result."""
        if self.error is not None:
            raise EngineDead(f"engine stopped: {self.error}")
        if self._stopped:
            raise EngineDead("engine stopped")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put((fn, args, kwargs, loop, future))
        self._wake.set()
        return await future

    async def call_or_undo(self, fn: Callable[[], Any], undo: Callable[[Any], None]) -> Any:
        """call(fn) for a command that acquires something (blocks): if the caller is cancelled while
        the command waits its turn, the command still runs, so undo(result) is queued behind it."""
        task = asyncio.ensure_future(self.call(fn))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:

            def undo_when_done(t: asyncio.Future) -> None:
                if not t.cancelled() and t.exception() is None and t.result() is not None:
                    self._commands.put((undo, (t.result(),), {}, t.get_loop(), t.get_loop().create_future()))
                    self._wake.set()

            task.add_done_callback(undo_when_done)
            raise

    async def stream(self, request_id: str, add: Callable[[], None]) -> AsyncIterator[RequestOutput]:
        """Runs `add` (which adds request_id to the engine) and yields the request's outputs until it
        finishes. Leaving early (cancellation, a closed stream) aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        registered = []

        def register_and_add():
            if request_id in self._streams:  # checked first: registering would orphan the live stream
                raise ValueError(f"request_id {request_id!r} is already running")
            self._streams[request_id] = (loop, outputs)
            try:
                add()
            except BaseException:
                del self._streams[request_id]
                raise
            registered.append(True)

        def abort_if_ours():  # runs after register_and_add (commands run in order): never a live twin's
            if registered:
                self._abort(request_id)

        # The add is queued at once; if we are cancelled while it waits its turn it still runs, so
        # an abort is queued behind it: the request can never be left running unwatched.
        added = asyncio.ensure_future(self.call(register_and_add))
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:
            await asyncio.shield(self.call(abort_if_ours))
            raise
        finished = False
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise EngineDead(f"engine stopped: {out}") from out
                if out.last:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            if not finished and self.error is None and not self._stopped:
                # Shielded: this runs while the caller is being cancelled. (A stopped engine has
                # nothing left to abort: its streams end with the node.)
                with contextlib.suppress(EngineDead):
                    await asyncio.shield(self.call(self._abort, request_id))

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._run_commands()
                if self.engine.has_unfinished():
                    started = time.perf_counter()
                    outputs = self.engine.step()
                    if self.engine.idle:  # waiting for blocks to come back: not a spin at 100% CPU
                        self._wake.wait(IDLE_WAIT_S)
                        self._wake.clear()
                        continue
                    if self.on_step is not None:
                        self.on_step(time.perf_counter() - started)
                    for out in outputs:
                        self._deliver(out.request_id, out)
                else:
                    self._wake.wait(0.1)
                    self._wake.clear()
            self._fail_commands(EngineDead("engine stopped"))  # nothing waits forever on a stopped engine
        except BaseException as e:  # a bug or a device failure: fail every caller, loudly
            log.exception("engine loop died")
            self.error = e
            for request_id in list(self._streams):
                self._deliver(request_id, e)
            self._fail_commands(e)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, args, kwargs, loop, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

    def _fail_commands(self, error: BaseException) -> None:
        while True:
            try:
                *_, loop, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                loop.call_soon_threadsafe(_set_exception, future, EngineDead(str(error)))
            except RuntimeError:  # the caller's event loop is gone
                pass

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, outputs = entry
        if isinstance(item, BaseException) or item.last:
            del self._streams[request_id]
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone
            pass


def _set_result(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
