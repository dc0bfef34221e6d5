"""Decides what runs in the next step; returns plain data and never touches tensors.

Lifecycle of a sequence: waiting -> running (prefill, possibly in chunks, of what the prefix cache
does not already hold; then decode one token per step) -> finished. When blocks run out, the
newest running sequence is preempted: its blocks are freed and it returns to the front of the
queue to be recomputed (prompt + output so far).

A waiting sequence at least half of whose uncached tokens another sequence's prefill is computing
(requests on one system prompt arriving together) waits for them and takes them from the cache,
as SGLang's in-batch prefix caching does, instead of computing the same prefix again beside it;
the sequences behind it go ahead meanwhile, its slot kept (not in static batching).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import FinishReason, Sequence, SequenceStatus


def one_token_behind(seq: Sequence) -> bool:
    """Its KV lags its tokens by one: a decode (or a sample forked from, or a request imported
    with, a prompt whose KV is there): no prompt's chunk."""
    return seq.num_computed_tokens == seq.num_tokens - 1


def waits_for_prefix(names: list[int], computing: set[int], block_size: int, uncomputed: int) -> bool:
    """In-batch prefix caching's rule: a prompt waits a step for the prefills computing its
    prefix when at least half of its uncomputed tokens are blocks being computed (names: its
    blocks a cache hit could give it, in order; computing: the names being computed). A short
    shared start, a chat template's header, is not worth a step's wait."""
    shared = 0
    while shared < len(names) and names[shared] in computing:
        shared += 1
    return 2 * shared * block_size >= uncomputed


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_scheduled_tokens: list[int]  # per sequence: KV positions to compute this step

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, max_model_len: int, eos_token_ids: tuple[int, ...]
    ):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefill_budget = config.max_num_batched_tokens  # this step's for prompt tokens (schedule)
        # Admissions keep a few blocks back so that running sequences can still grow.
        self.watermark_blocks = block_manager.num_blocks // 100
        self.num_preemptions = 0
        self.num_prefix_waits = 0  # steps a prompt was held back for another prefill (each step counts)

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queues a sequence (first: ahead of the others, e.g. samples forked from a running one)."""
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """One step's work: 1. the running sequences, oldest first (mostly one decode token each),
        preempting the newest when blocks run out; 2. waiting sequences while tokens, slots and
        blocks allow (none after a preemption: memory is short; static batching admits only into
        an empty batch). Beside decoding sequences, prompts get prefill_tokens_with_decodes of
        the budget at most (Sarathi-Serve's stall-free batching)."""
        batch = ScheduledBatch([], [])
        cfg = self.config
        self.prefill_budget = cfg.max_num_batched_tokens
        if cfg.prefill_tokens_with_decodes and cfg.enable_chunked_prefill and any(map(one_token_behind, self.running)):
            self.prefill_budget = cfg.prefill_tokens_with_decodes
        budget, preempted = self._schedule_running(batch, cfg.max_num_batched_tokens)
        if not preempted and not (cfg.scheduling == "static" and self.running):
            self._schedule_waiting(batch, budget)
        return batch

    def _limit(self, seq: Sequence, budget: int) -> int:
        """The most a sequence may compute this step: the budget, and for a prompt's chunk the
        prompts' share left (_scheduled spends it)."""
        return budget if one_token_behind(seq) else min(budget, self.prefill_budget)

    def _scheduled(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.add(seq, n)
        if not one_token_behind(seq):
            self.prefill_budget -= n

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> tuple[int, bool]:
        """Returns the token budget left and whether a sequence was preempted."""
        bm, preempted = self.block_manager, False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, self._limit(seq, budget))
            if n == 0:  # a prompt's chunk, with the prompts' budget spent: next step
                i += 1
                continue
            if seq.draft_token_ids:  # verify drafts only where they fit without pressing anyone
                drafted = n + len(seq.draft_token_ids)
                if drafted <= budget and bm.can_allocate(
                    seq, seq.num_computed_tokens + drafted, reserve=self.watermark_blocks
                ):
                    n = drafted
                else:
                    seq.draft_token_ids = []
            while not bm.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            bm.allocate(seq, seq.num_computed_tokens + n)
            self._scheduled(batch, seq, n)
            budget -= n
            i += 1
        return budget, preempted

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm, cfg = self.block_manager, self.config
        # (not in static batching: a prompt held back would wait out the whole batch)
        may_hold = bm.enable_prefix_caching and cfg.scheduling != "static"
        computing: set[int] | None = None  # names of blocks that running prefills will compute
        behind: list[Sequence] = []  # held back for one of those, or the prompts' budget; their slots are kept
        while self.waiting and len(self.running) + len(behind) < cfg.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not one_token_behind(seq) and self.prefill_budget <= 0:
                # the prompts' share of the step is spent: it waits a step, and the KV computed
                # elsewhere behind it goes on
                behind.append(self.waiting.popleft())
                continue
            looked_up = not seq.block_table  # a new or preempted sequence: its prefix may be cached
            if looked_up:
                seq.num_computed_tokens = bm.acquire_prefix(seq)
                if may_hold:
                    if computing is None:
                        computing = {name for s in self.running for name in bm.names_to_compute(s)}
                    uncomputed = seq.num_tokens - seq.num_computed_tokens
                    if waits_for_prefix(bm.shareable_names(seq), computing, bm.block_size, uncomputed):
                        bm.free(seq)
                        seq.num_computed_tokens = 0
                        behind.append(self.waiting.popleft())
                        self.num_prefix_waits += 1
                        continue
            n = seq.num_tokens - seq.num_computed_tokens
            fits = n <= self._limit(seq, budget) or cfg.enable_chunked_prefill
            n = min(n, self._limit(seq, budget))
            if not fits or not bm.can_allocate(seq, seq.num_computed_tokens + n, reserve=self.watermark_blocks):
                need = seq.num_computed_tokens + n
                if looked_up:  # wait without holding cached blocks
                    bm.free(seq)
                    seq.num_computed_tokens = 0
                if fits and not self.running and not batch.seqs and self._take_back_behind(seq, need):
                    continue  # nothing runs to free blocks: those of the sequences behind it were taken
                break
            if looked_up:
                bm.record_lookup(seq.num_tokens, seq.num_computed_tokens)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._scheduled(batch, seq, n)
            budget -= n
            if computing is not None:
                computing.update(bm.names_to_compute(seq))
        self.waiting.extendleft(reversed(behind))  # first in the queue again, in their order

    def update(self, batch: ScheduledBatch, sampled: list[list[int]]) -> list[Sequence]:
        """Records a step's results: per sequence, the tokens it emitted (none for a prefill chunk
        short of the end; with drafts, the accepted ones and the model's own). Returns the
        sequences that finished in it."""
        finished = []
        for seq, n, tokens in zip(batch.seqs, batch.num_scheduled_tokens, sampled):
            # KV is valid up to the last accepted draft; a rejected draft's positions are dropped.
            seq.num_computed_tokens += n - len(seq.draft_token_ids) + max(len(tokens) - 1, 0)
            seq.draft_token_ids = []
            if seq.is_finished:  # aborted meanwhile
                continue
            reason = None
            for j, token_id in enumerate(tokens):
                seq.output_token_ids.append(token_id)
                reason = self._stop_reason(seq, token_id)
                if reason is not None:
                    del tokens[j + 1 :]  # accepted drafts past the stop are not output
                    break
            # Blocks are named only now that the accepted drafts are in the output: a name hashes
            # the block's tokens, and a block filled by drafts named without them would be wrong.
            self.block_manager.cache_computed_blocks(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            else:
                self.block_manager.trim(seq, seq.num_tokens)  # blocks that held only rejected drafts
        return finished

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if seq.grammar is not None and seq.grammar.failed:
            return FinishReason.ERROR
        ends = (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids
        if ends and len(seq.output_token_ids) > params.min_tokens:  # before it, a draft's EOS is not an end
            return FinishReason.STOP
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        if seq.keep_kv:  # a prefill: its next token and KV go on to a decode node
            return FinishReason.HANDOFF
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends a sequence wherever it is and frees its blocks. Idempotent."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if not seq.keep_kv or reason is FinishReason.ABORT:
            self.block_manager.free(seq)  # else the engine moves seq.block_table into a kv_lease

    def _preempt(self, seq: Sequence) -> None:
        self._drop_kv(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        """Frees seq's blocks: it is recomputed (prompt + output so far) when admitted again."""
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        if seq.draft_state is not None:
            seq.draft_state.draft_computed = 0  # a draft model's KV went with the blocks
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _take_back_behind(self, head: Sequence, num_tokens: int) -> bool:
        """The queue's head cannot start, and nothing runs that would free blocks: sequences
        waiting behind it with blocks (imported KV, forked samples) would wait for it forever, and
        it for them. Their blocks are taken back, newest first, until the head fits (each is
        recomputed when its turn comes, as after a preemption). Returns whether any were."""
        bm, taken = self.block_manager, False
        for seq in reversed(self.waiting):
            if bm.can_allocate(head, num_tokens):
                break
            if seq is not head and seq.block_table:
                self._drop_kv(seq)
                taken = True
        return taken
