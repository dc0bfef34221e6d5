"""Incremental detokenization with stop strings.

Decoding a token on its own loses context (a leading space in sentencepiece, half of a UTF-8
character in byte-level BPE), so each step decodes a short window that starts a few tokens
back and emits only the text that is new and complete.
"""

from __future__ import annotations

PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        # While a stop string could still be completing, its first characters are held back.
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far, cut before a stop string
        self.num_emitted = 0  # characters of `text` already returned to the caller
        self.num_tokens, self.min_tokens = 0, min_tokens  # stop strings end the output only past min_tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int, final: bool = False) -> tuple[str, bool]:
        """Adds one generated token. Returns (text to stream now, whether a stop string ended the
        output). `final` says no token follows, so nothing is held back."""
        self.ids.append(token_id)
        self.num_tokens += 1
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        stopped = False
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            stopped = self._append(full[len(prefix) :])
        hold = 0 if final or stopped else self.hold_back
        end = max(self.num_emitted, len(self.text) - hold)
        delta, self.num_emitted = self.text[self.num_emitted : end], end
        return delta, stopped

    def _append(self, delta: str) -> bool:
        if self.stop and self.num_tokens > self.min_tokens:
            # A stop string may straddle earlier text and this delta.
            start = max(0, len(self.text) - self.hold_back)
            window = self.text[start:] + delta
            # only matches that reach into the delta (earlier text was checked, or under min_tokens not stoppable)
            hits = [i for s in self.stop if (i := window.find(s, max(0, len(window) - len(delta) - len(s) + 1))) >= 0]
            if hits:
                self.text = self.text[:start] + window[: min(hits)]
                return True
        self.text += delta
        return False
