"""Per-request sampling parameters, validated at construction with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_SAMPLES = 16  # n and best_of
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam step asks for the top 2 x width logprobs
MAX_STOP_STRINGS, MAX_STOP_LEN = 16, 256
MAX_CACHE_SALT = 1024
MAX_LOGIT_BIAS, MAX_BAD_WORDS, MAX_REPETITION_PENALTY = 1024, 256, 10.0


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
    # Before the draw (engine/penalties.py, vLLM's semantics): each token's logit minus
    # presence_penalty once it is in the output and frequency_penalty per time it is; divided by
    # repetition_penalty (multiplied where negative) once it is in the prompt or the output;
    # logit_bias added ({token id: bias}); min_p drops tokens less likely than min_p x the top one;
    # EOS and stop_token_ids banned until min_tokens; bad words' last tokens banned where the
    # output ends with the rest of the word (ids: the router tokenizes `bad_words` strings).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # The output held to a JSON schema, any JSON object, a regex, a choice or a grammar
    # (engine/structured_output.py); it ends where the grammar may end and the model says EOS.
    structured_output: StructuredOutput | None = None

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
        self._check_penalties()

    def _check_penalties(self):
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            limit = MAX_REPETITION_PENALTY
            raise ValueError(f"repetition_penalty must be in (0, {limit}], got {self.repetition_penalty!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        try:
            bias = tuple(sorted((int(t), b) for t, b in bias))  # OpenAI's JSON keys are strings
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        if len(bias) > MAX_LOGIT_BIAS or any(t < 0 or not _is_number(b) or not -100 <= b <= 100 for t, b in bias):
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} token ids >= 0, each biased by [-100, 100]")
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in bias))
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens {self.max_tokens}], got {self.min_tokens!r}")
        words = tuple(tuple(w) for w in self.bad_words_token_ids or ())
        if len(words) > 2 * MAX_BAD_WORDS or any(not w or any(not _is_int(t) or t < 0 for t in w) for w in words):
            raise ValueError(
                f"bad_words: at most {2 * MAX_BAD_WORDS} token sequences ({MAX_BAD_WORDS} words, two spellings "
                "each), each of one or more token ids >= 0"
            )
        object.__setattr__(self, "bad_words_token_ids", words)
        if self.beam_width > 1 and (self.penalized or self.min_p):
            raise ValueError("beam search takes no penalties, logit_bias, min_p, min_tokens or bad_words")
        so = self.structured_output
        if so is not None:
            if not isinstance(so, StructuredOutput):
                raise ValueError(f"structured_output must be a StructuredOutput, got {type(so).__name__}")
            if self.ignore_eos or self.min_tokens or self.bad_words_token_ids:
                # each could leave a row no token the grammar allows (its end is EOS)
                raise ValueError("structured_output takes no ignore_eos, min_tokens or bad_words")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raises ValueError naming logit_bias or bad_words where an id is outside the vocabulary."""
        if any(t >= vocab_size for t, _ in self.logit_bias):
            raise ValueError(f"logit_bias: token ids must be below the vocabulary size {vocab_size}")
        if any(t >= vocab_size for word in self.bad_words_token_ids for t in word):
            raise ValueError(f"bad_words: token ids must be below the vocabulary size {vocab_size}")

    @property
    def penalized(self) -> bool:
        """Whether anything changes the logits before the draw (engine/penalties.py)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
            or self.bad_words_token_ids
        )

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
