"""Speculative decoding: its settings, and the n-gram (prompt lookup) proposer.

A proposer drafts up to k next tokens for each decoding sequence; the target model computes all of
them in one forward, as k + 1 queries over the paged KV (engine/model_runner.py), samples each
position as it would have without drafts, and keeps drafts while they equal what it sampled,
plus its own token at the first difference (or after the last draft). For a proposer that drafts
deterministically (n-gram) this is exactly speculative sampling's rejection rule: a draft x is
kept with probability p(x) = min(1, p(x) / q(x)) for q a point mass, and the token that replaces
it is drawn from p with x removed, the normalised residual max(0, p - q). So the output
distribution is unchanged, and with a seed (or greedy) the tokens are the very tokens decoding
without speculation gives. The KV of rejected drafts is rolled back: the sequence's computed
length stops before them and blocks past its tokens are trimmed (engine/scheduler.py).

The n-gram proposer needs no second model: it finds the sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) earlier in its prompt and output, preferring the
most recent match with k tokens after it, and drafts what followed them there. Strong where the
output copies the input (editing, summarising, code). Where drafts keep failing it backs off: a
sequence's acceptance is an average over its recent verifications, the draft length follows it,
and below min_acceptance the sequence drafts nothing for a while before trying again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.sequence import DraftState, Sequence

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: most tokens drafted per step
    prompt_lookup_max: int = 4  # longest suffix looked up
    prompt_lookup_min: int = 2  # shortest suffix looked up
    min_acceptance: float = 0.2  # below this average acceptance a sequence pauses drafting
    pause_steps: int = 8  # how long such a pause lasts
    draft_model: str | None = (
        None  # method draft_model: a model with the target's vocabulary (engine/draft_proposer.py)
    )

    @classmethod
    def from_dict(cls, settings: dict) -> SpeculativeConfig:
        if not isinstance(settings, dict):
            raise ValueError(
                f"speculative must be a dict such as {{'method': 'ngram', "
                f"'num_speculative_tokens': 4}}, got {settings!r}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"speculative: unknown setting(s) {unknown}; known: {sorted(known)}")
        return cls(**settings)

    def __post_init__(self):
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"speculative.{name} must be {allowed}, got {getattr(self, name)!r}")

        check(self.method in METHODS, "method", f"one of {METHODS}")
        check(
            _is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            "num_speculative_tokens",
            f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]",
        )
        check(_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1, "prompt_lookup_min", "an integer >= 1")
        check(
            _is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
            "prompt_lookup_max",
            f"an integer >= prompt_lookup_min ({self.prompt_lookup_min})",
        )
        check(
            isinstance(self.min_acceptance, (int, float)) and 0 <= self.min_acceptance <= 1,
            "min_acceptance",
            "in [0, 1]",
        )
        check(_is_int(self.pause_steps) and self.pause_steps >= 0, "pause_steps", "an integer >= 0")
        check(
            (self.method == "draft_model") == isinstance(self.draft_model, str) and self.draft_model != "",
            "draft_model",
            "a model name or path with method 'draft_model' (and only then)",
        )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def first_rejected(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts are kept: those before the first that differs from the token the target
    sampled at its position (sampled has one more entry: the token after the last draft)."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return j
    return len(drafts)


def observe(config: SpeculativeConfig, state: DraftState, num_drafted: int, num_accepted: int) -> None:
    """Records a verification's result in a sequence's state; drafting pauses while acceptance
    stays low."""
    state.acceptance = 0.7 * state.acceptance + 0.3 * num_accepted / num_drafted
    if state.acceptance < config.min_acceptance and config.pause_steps:
        state.paused = config.pause_steps


def draft_length(config: SpeculativeConfig, state: DraftState, seq: Sequence, max_model_len: int) -> int:
    """How many tokens to draft for seq this step (0 while paused): k scaled by its recent
    acceptance, never past max_tokens (emitted = accepted + 1) or the context."""
    if state.paused:
        state.paused -= 1
        if not state.paused:
            state.acceptance = config.min_acceptance  # try again, on probation
        return 0
    return min(
        max(1, round(config.num_speculative_tokens * state.acceptance)),
        seq.params.max_tokens - len(seq.output_token_ids) - 1,
        max_model_len - seq.num_tokens,
    )


def ngram_draft(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of `tokens` (n_max
    down to n_min tokens long): the most recent occurrence with k tokens after it, else the first
    (in a loop, the latest occurrence is followed only by the loop's last turn)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows starting at 0 .. length-n-1: each has at least one token after it.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            whole = hits[hits + n + k <= length]
            start = int(whole[-1] if whole.size else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, seqs: list[Sequence]) -> None:
        """Sets draft_token_ids on each sequence that decodes next step (one token to compute)."""
        cfg = self.config
        for seq in seqs:
            seq.draft_token_ids = []
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.keep_kv:
                continue
            state = seq.draft_state or self._state(seq)
            k = draft_length(cfg, state, seq, self.max_model_len)
            if k < 1:
                continue
            self._sync(seq, state)
            seq.draft_token_ids = ngram_draft(
                state.tokens[: state.length], k, cfg.prompt_lookup_min, cfg.prompt_lookup_max
            )

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        observe(self.config, seq.draft_state, num_drafted, num_accepted)

    def _state(self, seq: Sequence) -> DraftState:
        seq.draft_state = DraftState(np.empty(max(64, 2 * seq.num_tokens), dtype=np.int64))
        return seq.draft_state

    @staticmethod
    def _sync(seq: Sequence, state: DraftState) -> None:
        """Appends the tokens the array lacks (a preempted-and-recomputed sequence keeps its tokens)."""
        n = seq.num_tokens
        if n > len(state.tokens):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[: state.length] = state.tokens[: state.length]
            state.tokens = grown
        if state.length < n:
            state.tokens[state.length : n] = seq.token_ids(state.length, n)
            state.length = n
