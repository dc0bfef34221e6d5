"""A prefill's KV as it is written, layer by layer, for whoever sends it on while the later
layers still compute (layer-wise KV streaming, as vLLM's and SGLang's layer-wise connectors do).

The engine thread publishes: `scheduled` once the prompt's last chunk is in a step (its blocks
are fixed from then on), `layer_done(i)` as the forward finishes writing layer i. Whoever owns
the request adds the outcome (`finish`) or an error (`fail`). Other threads wait on any of it.
On the CPU a layer is written when its attention returns; on CUDA a layer's event is recorded
and waited on before its bytes are read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class PrefillFailed(RuntimeError):
    """The prefill ended without its KV (aborted, failed, or its engine died)."""


class LayerProgress:
    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.block_table: list[int] = []
        self.num_tokens = 0
        self.layers_done = 0
        self.outcome: dict | None = None
        self.error: str | None = None
        self.on_scheduled: Callable[[], None] | None = None  # called in the engine thread
        self._events: list = []  # CUDA: one event per finished layer
        self._cond = threading.Condition()

    # ---- the engine thread ----------------------------------------------------------------
    def scheduled(self, block_table: list[int], num_tokens: int) -> None:
        with self._cond:
            self.block_table, self.num_tokens = list(block_table), num_tokens
            self._cond.notify_all()
        if self.on_scheduled is not None:
            self.on_scheduled()

    def layer_done(self, layer: int, event=None) -> None:
        with self._cond:
            self._events.append(event)
            self.layers_done = layer + 1
            self._cond.notify_all()

    # ---- the request's owner ----------------------------------------------------------------
    def finish(self, outcome: dict) -> None:
        with self._cond:
            self.outcome = outcome
            self._cond.notify_all()

    def fail(self, error: str) -> None:
        with self._cond:
            if self.outcome is None and self.error is None:
                self.error = error
            self._cond.notify_all()

    # ---- readers (any thread) -----------------------------------------------------------------
    def wait_layer(self, layer: int, timeout_s: float) -> None:
        """Returns once layer `layer` is written; raises PrefillFailed or TimeoutError."""
        self._wait(lambda: self.layers_done > layer, timeout_s, f"layer {layer}")
        event = self._events[layer]
        if event is not None:
            event.synchronize()

    def wait_outcome(self, timeout_s: float) -> dict:
        self._wait(lambda: self.outcome is not None, timeout_s, "the first token")
        return self.outcome

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: ready() or self.error is not None, timeout_s):
                raise TimeoutError(f"prefill did not produce {what} within {timeout_s:.0f} s")
            if not ready():
                raise PrefillFailed(self.error)
