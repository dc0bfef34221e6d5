"""What the engine hands back per request: the whole result so far and the latest increment."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated ids so far (includes EOS / stop ids when they ended it)
    text: str  # generated text so far, cut before a stop string
    new_token_ids: list[int] = field(default_factory=list)  # generated in the latest step
    new_text: str = ""  # text that became final in the latest step
    finished: bool = False  # this sample is done
    finish_reason: str | None = None  # "stop", "length", "abort", "error" (its grammar failed)
    logprobs: list[dict[int, float]] | None = None  # per generated token, when asked
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    index: int = 0  # which of the request's n samples
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with logprobs or best_of)
    samples: list[RequestOutput] | None = None  # LLM.generate with n > 1: every sample, by index
    request_finished: bool | None = None  # no output of this request follows (None: same as finished)

    @property
    def last(self) -> bool:
        """Whether this is the request's last output (every sample done)."""
        return self.finished if self.request_finished is None else self.request_finished
