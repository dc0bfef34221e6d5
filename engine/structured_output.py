"""Constrained decoding: a request's output held to a JSON schema, any JSON object, a regular
expression, a choice of strings or a grammar (Lark or GBNF), by llguidance's matcher.

Each sequence that samples under a grammar has a matcher of its own (n > 1: one per sample),
made from the compiled grammar and brought up to date from the sequence's own output tokens
before each step: so a request prefilled elsewhere, migrated, preempted or forked carries no
matcher state, only its tokens. A step's rows get the matcher's token mask (every token the
grammar allows next; EOS once it may end); a verification's rows get the masks after each draft
before them, tried and rolled back, so a draft the grammar refuses is masked out of its own row
and rejected. Grammars compile once per (kind, spec), cached; a matcher costs well under a
millisecond to make.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20
CACHED_GRAMMARS = 256
# JSON without whitespace between tokens (as json.dumps(separators=(",", ":")) writes it): a model cannot pad
# its output with whitespace until max_tokens. A schema's own "x-guidance" options win.
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True)
class StructuredOutput:
    """kind: one of KINDS; spec: the schema as JSON text (json_schema), the regular expression,
    the choices as a JSON list of strings, the grammar's text (Lark or GBNF); empty for json_object."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured_output.kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_output.spec must be a string of at most {MAX_SPEC_CHARS} characters")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured_output: a {self.kind} needs its spec")

    def grammar(self) -> str:
        """llguidance's grammar of it; raises ValueError naming structured_output where the spec is malformed."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.grammar_from("json_schema", json.dumps({"type": "object", **COMPACT}))
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError as e:
                raise ValueError(f"structured_output: the {self.kind} is not valid JSON ({e})") from None
            if self.kind == "choice" and (
                not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value)
            ):
                raise ValueError("structured_output: choice must be a non-empty list of non-empty strings")
            if self.kind == "json_schema":
                if not isinstance(value, dict):
                    raise ValueError("structured_output: json_schema must be a JSON object")
                return llguidance.grammar_from("json_schema", json.dumps({**COMPACT, **value}))
        return llguidance.grammar_from(self.kind, self.spec)


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it, and each grammar checked once against it. Made
    when the engine or router starts (about half a second for a 50k vocabulary), not on a request's
    path; a tokenizer llguidance cannot take (not a fast one) leaves structured output refused, naming why."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import llguidance.hf

        self.tokenizer, self.error = None, "this engine has no tokenizer"
        if tokenizer is not None:
            try:
                self.tokenizer = llguidance.hf.from_tokenizer(
                    tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
                )
            except Exception as e:  # noqa: BLE001 (whatever llguidance raises, the model is served)
                self.error = f"the tokenizer is not supported by llguidance ({e})"
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self._cache: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._lock = threading.Lock()  # a router compiles on worker threads

    def compile(self, so: StructuredOutput) -> str:
        """The grammar, validated; raises ValueError naming what is wrong (a 400 before any work)."""
        import llguidance

        if self.tokenizer is None:
            raise ValueError(f"structured_output: not available: {self.error}")
        with self._lock:
            grammar = self._cache.get(so)
        if grammar is None:
            grammar = so.grammar()
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
            if error:
                raise ValueError(f"structured_output: the {so.kind} is invalid: {' '.join(error.split())[:500]}")
        with self._lock:
            self._cache[so] = grammar
            self._cache.move_to_end(so)
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, so: StructuredOutput):
        import llguidance

        return llguidance.LLMatcher(self.tokenizer, self.compile(so))


class SequenceGrammar:
    """A sequence's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher):
        self.matcher, self.num_consumed = matcher, 0
        self.failed = False  # the matcher refused a token: the sequence ends with FinishReason.ERROR

    def catch_up(self, output_token_ids: list[int]) -> bool:
        """Consumes the tokens since the last call; False where the matcher refused one (llguidance
        in an error state, e.g. out of its parser's fuel): never raised, so other requests go on."""
        new = output_token_ids[self.num_consumed :]
        self.num_consumed = len(output_token_ids)
        return not new or self.matcher.consume_tokens(new)


def fill_masks(compiler: GrammarCompiler, rows: list[tuple[object, list[int]]]) -> torch.Tensor:
    """rows: per logit row (its sequence, the drafts before it). Returns int32 bitmasks [R, ceil(V / 32)]
    (all ones for a sequence without a grammar)."""
    masks = torch.full((len(rows), (compiler.vocab_size + 31) // 32), -1, dtype=torch.int32)
    for r, (seq, drafts) in enumerate(rows):
        so = seq.params.structured_output
        if so is None:
            continue
        if seq.grammar is None:
            seq.grammar = SequenceGrammar(compiler.matcher(so))
        state = seq.grammar
        if state.failed or not state.catch_up(seq.grammar_history()):  # EOS ends it, finishing with "error"
            if not state.failed:
                log.error("structured_output: request %s: %s; ended", seq.request_id, state.matcher.get_error())
            state.failed = True
            masks[r] = 0
            for t in compiler.eos_token_ids:
                masks[r, t // 32] |= 1 << (t % 32)
            continue
        tried = state.matcher.try_consume_tokens(list(drafts)) if drafts else 0
        if tried == len(drafts):  # else a draft before this row left the grammar: the row is never kept
            state.matcher.unsafe_compute_mask_ptr(masks[r].data_ptr(), masks.shape[1] * 4)
        if tried:
            state.matcher.rollback(tried)
    return masks


_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # byte -> its 8 bits, low first


@torch.inference_mode()  # logits come from the forward's inference mode
def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Sets to -inf each of logits[rows]'s tokens whose bit is 0 (in place; rows ascending). The
    bits unpack a byte at a time through a table, and each run of consecutive rows is filled as
    one slice (no gather and scatter of the rows)."""
    allowed = _BITS[masks.view(torch.uint8).long()].view(len(rows), -1)[:, : logits.shape[1]]
    allowed = allowed.to(logits.device)
    start = 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or rows[end] != rows[end - 1] + 1:
            logits[rows[start] : rows[end - 1] + 1].masked_fill_(~allowed[start:end], float("-inf"))
            start = end
