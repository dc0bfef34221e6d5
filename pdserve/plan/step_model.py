"""What one engine step costs: a line over what the step holds, fitted to measured steps.

    seconds = fixed + per_token x tokens + per_pair x prefill attention pairs / 1e3
              + per_context x decode context tokens / 1e3 + per_sequence x sequences
              + per_cached x prefill chunks' tokens already in their KV / 1e3
              + per_distinct x distinct decode context tokens / 1e3

tokens: every position computed in the step (prefill chunks and one per decoding sequence); prefill
attention pairs: for each prefill chunk of n new tokens after c tokens already in its KV, n x (c +
(n + 1) / 2) (the causal attention's query-key pairs); decode context: the KV tokens each decoding
sequence attends to; a prefill chunk's tokens already in its KV (a cached prefix, earlier chunks)
are read once for the chunk, whatever its length (two threads, AVX512_BF16, bf16: a 16-token
prefill after 1,024 cached tokens took 80 ms against 49 ms with none cached; the line without this
term put it at 50 ms; docs/bench/plan_profile_avx512bf16.json); distinct decode context: the decode
context less Step.shared, the tokens of the copies of blocks that several decoding sequences of the
step hold (a shared prefix's blocks are read from memory once a step: one thread, bf16, 2 x 1,024
tokens took 38 ms sharing no block against 31 ms for 4 x 640 sharing all but the last; the line
without this term put the first at 32 ms; docs/bench/plan_profile_avx512bf16_distinct.json). The
same line prices a prefill node's batch of prompts, a decode step, and a mixed step (a local
prefill's chunk in a decode batch). Fitted by least squares on relative error (a 20 ms decode step
counts as much as a 2 s prefill), coefficients kept >= 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

TERMS = ("fixed", "per_token", "per_pair", "per_context", "per_sequence", "per_cached", "per_distinct")


@dataclass
class Step:
    """What one step computes: prefill chunks as (new tokens, tokens already in the KV), the
    context length of each decoding sequence, and shared: for each block that k decoding
    sequences of the step hold, k - 1 blocks' tokens (a shared block is read once)."""

    prefills: list[tuple[int, int]]
    decodes: list[int]
    shared: int = 0

    def features(self) -> list[float]:
        tokens = sum(n for n, _ in self.prefills) + len(self.decodes)
        pairs = sum(n * (c + (n + 1) / 2) for n, c in self.prefills) / 1e3
        cached = sum(c for _, c in self.prefills) / 1e3
        context = sum(self.decodes) / 1e3
        sequences = len(self.prefills) + len(self.decodes)
        return [1.0, tokens, pairs, context, sequences, cached, context - self.shared / 1e3]


def shared_tokens(blocks: list[list], block_size: int) -> int:
    """Step.shared of decoding sequences holding these blocks (ids or names, one list each)."""
    return (sum(len(b) for b in blocks) - len({x for b in blocks for x in b})) * block_size


@dataclass
class StepModel:
    fixed: float
    per_token: float
    per_pair: float
    per_context: float
    per_sequence: float
    per_cached: float = 0.0  # (profiles before it: 0)
    per_distinct: float = 0.0  # (profiles before it: 0)

    def seconds(self, step: Step) -> float:
        return sum(c * f for c, f in zip(self.coefficients(), step.features()))

    def coefficients(self) -> list[float]:
        return [getattr(self, t) for t in TERMS]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def fit(cls, samples: list[tuple[Step, float]]) -> StepModel:
        """Least squares on relative error with every coefficient >= 0 (a term fitted negative is
        dropped and the rest refitted). Without a sample that shares blocks the distinct context
        is the context: per_distinct stays 0."""
        x = np.array([s.features() for s, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        w = 1.0 / y
        active = list(range(len(TERMS)))
        if not any(s.shared for s, _ in samples):
            active.remove(TERMS.index("per_distinct"))
        while True:
            coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
            if (coef >= 0).all():
                break
            active.pop(int(np.argmin(coef)))
        full = np.zeros(len(TERMS))
        full[active] = coef
        return cls(*full.tolist())
