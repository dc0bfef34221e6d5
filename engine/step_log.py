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
        # owner-only even where the file was there before; never through a symbolic link
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(self.fd, 0o600)
        self.block_size, self.pid = block_size, os.getpid()

    def describe(self, batch: ScheduledBatch) -> dict:
        """What the step computes, read before it runs. A decode is a sequence with output whose
        KV lags its tokens by one; one verifying d drafts is d + 1 single-token queries, each
        logged as a decode of its own context (as the model runner computes them). Anything else
        is a prefill chunk (a prompt's, or a preempted sequence's recompute), even of one token."""
        prefills, decodes, held, ending, drafts = [], [], Counter(), 0, 0
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
            if seq.output_token_ids and seq.num_computed_tokens == seq.num_tokens - 1:
                decodes.extend(range(seq.num_tokens, seq.num_tokens + n))
                drafts += n - 1
                held.update(seq.block_table[: seq.num_computed_tokens // self.block_size])
            else:
                prefills.append([n, seq.num_computed_tokens])
                ending += seq.num_computed_tokens + n >= seq.num_tokens
        shared = sum(k - 1 for k in held.values()) * self.block_size
        return {"prefills": prefills, "ending": ending, "decodes": decodes, "drafts": drafts, "shared": shared}

    def write(self, step: dict, started: float, seconds: float) -> None:
        line = {"pid": self.pid, "t": started, "s": seconds, **step}
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        while data:  # one write on a local file: several processes' lines stay whole
            data = data[os.write(self.fd, data) :]
