"""Parallel sampling: n (or best_of) samples of one prompt from one prefill.

A request's first sequence (sample 0) prefills like any other. Once its prompt's KV is computed,
samples 1..N-1 fork from it: each takes one more reference to the prompt's full blocks before the
block that holds the last prompt token, and a private copy of that block (copy-on-write: it is the
block the next positions are written into), then computes only the last prompt token itself, in
the next step, to sample its own first token with its own seed stream. On a decode node the fork
happens when the imported KV is admitted: one prefill and one transfer for all N samples. With
best_of > n, the samples' outputs are held until all are done, and the n with the highest
cumulative logprob are returned, renumbered 0..n-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.block_manager import BlockManager
from engine.kv_cache import KVCache
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass
class SampleGroup:
    params: SamplingParams  # the request's
    live: int  # samples not finished
    forked: bool = False
    done: list[RequestOutput] = field(default_factory=list)

    @property
    def ranks(self) -> bool:
        return self.params.num_samples > self.params.n

    def emit(self, out: RequestOutput) -> list[RequestOutput]:
        """What the caller sees of one sample's output: itself, or (best_of) nothing until the
        last sample ends, then the n best."""
        if out.finished:
            self.live -= 1
        if not self.ranks:
            return [replace(out, request_finished=not self.live)]
        if out.finished:
            self.done.append(out)
        if self.live:
            return []
        best = sorted(self.done, key=lambda o: (-o.cumulative_logprob, o.index))[: self.params.n]  # ties: by index
        logprobs = self.params.logprobs is not None
        return [
            replace(
                o,
                index=i,
                new_token_ids=list(o.token_ids),
                new_text=o.text,
                logprobs=o.logprobs if logprobs else None,
                request_finished=i == len(best) - 1,
            )
            for i, o in enumerate(best)
        ]


def fork(
    parent: Sequence, params: SamplingParams, block_manager: BlockManager, kv_cache: KVCache, reserve: int
) -> list[Sequence]:
    """Samples 1..N-1 of parent's request, sharing its computed prompt KV. A sample that finds no
    free block for its copy starts from its prompt instead (the prefix cache still shares it)."""
    bm, num_prompt = block_manager, parent.num_prompt_tokens
    shared = (num_prompt - 1) // bm.block_size  # full blocks before the last prompt token's block
    # Sample params keep logprob tracking on where best_of ranks by it.
    track = 0 if params.num_samples > params.n and params.logprobs is None else params.logprobs
    children = []
    for index in range(1, params.num_samples):
        child = Sequence(
            parent.request_id,
            list(parent.prompt_token_ids),
            replace(params.for_sample(index), logprobs=track),
            index=index,
            num_cached_tokens=parent.num_cached_tokens,
        )
        if bm.num_free_blocks > reserve:
            table = parent.block_table[:shared]
            bm.incref(table)
            child.block_table = table + bm.allocate_blocks(1)
            kv_cache.copy_block(parent.block_table[shared], child.block_table[-1])
            child.num_computed_tokens = num_prompt - 1
        children.append(child)
    return children
