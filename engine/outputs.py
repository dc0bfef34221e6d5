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
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort"
    logprobs: list[dict[int, float]] | None = None  # per generated token, when asked
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
