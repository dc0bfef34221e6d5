"""Per-request sampling parameters, validated at construction with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass, replace

MAX_LOGPROBS = 20
MAX_SAMPLES = 16  # n and best_of
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam step asks for the top 2 x width logprobs
MAX_STOP_STRINGS, MAX_STOP_LEN = 16, 256
MAX_CACHE_SALT = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables; otherwise keep the k most likely tokens
    top_p: float = 1.0  # applied after top_k: smallest set whose probability reaches top_p
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()  # stop strings; the output text ends before the first one
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled one)
    n: int = 1  # completions returned (parallel sampling: one prefill, the prompt's KV blocks shared)
    best_of: int | None = None  # completions generated, the n with the highest cumulative logprob returned
    beam_width: int = 1  # > 1: beam search (engine/beam_search.py), returning its W hypotheses, best first
    length_penalty: float = 1.0  # beam search: a hypothesis scores logprob / length ** length_penalty
    # Prefix caching: only requests with the same salt share cached blocks (vLLM's cache_salt); a
    # router with API keys prefixes each key's own (engine/block_manager.py, README)
    cache_salt: str = ""

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in stop):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LEN} characters")
        if len(self.stop_token_ids) > 1024:
            raise ValueError("stop_token_ids: at most 1024 ids")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_SAMPLES):
            raise ValueError(
                f"best_of must be an integer in [n ({self.n}), {MAX_SAMPLES}] or None, got {self.best_of!r}"
            )
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT:
            raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters")
        if not _is_number(self.length_penalty) or self.length_penalty != self.length_penalty:
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if self.beam_width > 1:
            if self.n > self.beam_width:  # the OpenAI API returns the n best of the W
                raise ValueError(f"n must be <= beam_width ({self.beam_width}) with beam search, got {self.n}")
            if self.best_of is not None:
                raise ValueError("best_of does not apply to beam search (beam_width sets the hypotheses kept)")
            if stop:
                raise ValueError("stop strings are not supported with beam search (stop_token_ids are)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Sequences sampled for the request: best_of, or n (beam search samples none)."""
        return 1 if self.beam_width > 1 else self.best_of or self.n

    @property
    def forks(self) -> bool:
        """Whether the request runs as several sequences over one prompt's KV (n, best_of, beams)."""
        return self.num_samples > 1 or self.beam_width > 1

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of a request: one sequence each, its own seed stream
        (sample 0 keeps the request's seed, so n=1 and the first of n agree)."""
        seed = self.seed
        if seed is not None and index:
            seed = (seed * 0x9E3779B97F4A7C15 + index) & 0x7FFF_FFFF_FFFF_FFFF
        return replace(self, n=1, best_of=None, seed=seed)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
