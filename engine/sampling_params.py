"""Per-request sampling parameters, validated at construction with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20
MAX_STOP_STRINGS, MAX_STOP_LEN = 16, 256


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
