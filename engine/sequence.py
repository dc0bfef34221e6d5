"""A request inside the engine: its tokens, how many have KV computed, and its blocks.

One rule drives scheduling (as in vLLM v1): a sequence has `num_tokens` tokens and KV for the
first `num_computed_tokens`; each step closes part of that gap. Prefill, chunked prefill, decode
and recompute after preemption are all the same rule.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from engine.kv_progress import LayerProgress
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller
    HANDOFF = "handoff"  # a prefill whose request goes on elsewhere (LLMEngine.add_prefill)
    ERROR = "error"  # its grammar's matcher failed: the output is not known to be in the grammar


@dataclass
class DraftState:
    """A sequence's speculative-decoding state (engine/speculative.py): its recent acceptance; for
    the n-gram proposer its tokens as an array (grown, not rebuilt), for the draft model how far
    its draft KV is computed."""

    tokens: np.ndarray | None
    length: int = 0
    acceptance: float = 1.0  # moving average of accepted / drafted
    paused: int = 0  # steps left without drafts
    draft_computed: int = 0  # draft model: positions whose draft KV is written


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    keep_kv: bool = False  # a prefill to hand off: on finish its blocks pass to a kv_lease, not the free list
    kv_progress: LayerProgress | None = None  # layer-wise streaming: the prefill's KV as it is written
    arrival_time: float = field(default_factory=time.monotonic)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    block_hashes: list[int] = field(default_factory=list)  # names of its full blocks (engine/block_manager.py)
    num_named_blocks: int = 0  # leading blocks of block_table already in the prefix cache
    # Per named block: the cached block (id, generation) holding that prefix (engine/block_manager.py)
    cache_chain: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding (engine/speculative.py): tokens proposed to follow this step's token,
    # verified in the same forward, and the proposer's state.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_state: DraftState | None = None
    grammar: object = None  # structured output: its matcher (engine/structured_output.SequenceGrammar), made lazily
    grammar_prefix: int = 0  # a beam step: its prompt's last tokens (the beam's) come before the output in the grammar
    # Parallel sampling (engine/parallel_sampling.py): which of the request's samples this is, and
    # the log-probability of its tokens so far (when asked for: best_of).
    index: int = 0
    cumulative_logprob: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def grammar_history(self) -> list[int]:
        """The tokens its grammar has seen: the output, after a beam step's own beam."""
        if not self.grammar_prefix:
            return self.output_token_ids
        return self.prompt_token_ids[len(self.prompt_token_ids) - self.grammar_prefix :] + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output + drafts without building the whole list."""
        if end > self.num_tokens:
            return (
                self.token_ids(start, self.num_tokens)
                + self.draft_token_ids[max(0, start - self.num_tokens) : end - self.num_tokens]
            )
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
