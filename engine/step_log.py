"""One JSON line per engine step (EngineConfig.step_log), to set served steps beside the planner's
step line: what the line prices (pdserve/plan/step_model.py's Step: prefill chunks as [new, cached]
tokens, the decoding sequences' contexts, the KV tokens they share), how many chunks end their
prompt, and how long the step took, from before scheduling to its outputs. Appended by each engine
process (its pid on each line), to a file only its owner may read."""

from __future__ import annotations

import json
import os
from collections import Counter

from engine.scheduler import ScheduledBatch


class StepLog:
    def __init__(self, path: str, block_size: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.block_size, self.pid = block_size, os.getpid()

    def describe(self, batch: ScheduledBatch) -> dict:
        """What the step computes, read before it runs."""
        prefills, decodes, held, ending = [], [], Counter(), 0
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
            last = seq.num_computed_tokens + n >= seq.num_tokens
            if last and n <= 1 + len(seq.draft_token_ids):
                decodes.append(seq.num_tokens)
                held.update(seq.block_table[: seq.num_computed_tokens // self.block_size])
            else:
                prefills.append([n, seq.num_computed_tokens])
                ending += last
        shared = sum(k - 1 for k in held.values()) * self.block_size
        return {"prefills": prefills, "ending": ending, "decodes": decodes, "shared": shared}

    def write(self, step: dict, started: float, seconds: float) -> None:
        line = {"pid": self.pid, "t": started, "s": seconds, **step}
        os.write(self.fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())  # one write: lines stay whole
