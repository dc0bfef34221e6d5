"""Turns a step's logits into tokens: penalties (engine/penalties.py), then greedy, or
temperature -> min-p -> top-k -> top-p -> random draw.

The draw is an exponential race (argmax of probs / Exp(1) noise), which samples exactly from
`probs`. A request with a seed draws the noise for its i-th output token from a generator seeded
by (seed, i) alone, so its tokens depend on nothing else: not on the rest of the batch, not on
preemption, and not on which node (prefill or decode) samples which token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.penalties import apply_penalties
from engine.sampling_params import SamplingParams

MASKED_LOGPROB = -9999.0  # a masked token's logprob, -inf clamped (as vLLM) so that JSON can carry it


@dataclass
class SamplerOutput:
    token_ids: list  # per row: the sampled id (the model runner: per sequence, a list of ids)
    logprobs: list  # per row: {token: logprob} for top-n + the sampled one, or None


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [N, V]; top_k: [N] (0 disables); top_p: [N] (1 disables). Returns logits with the
    removed candidates set to -inf. Top-k keeps every token tied with the k-th; top-p then keeps
    the smallest most-likely set whose probability mass reaches top_p (at least one token)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # ties: lower id first, in any batch
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)  # top_p == 1 keeps all, rounding aside
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int, device: torch.device, eos_token_ids: tuple[int, ...] = ()):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.scratch = torch.Generator(device=device)  # reseeded per (request seed, step)
        self.eos_token_ids = eos_token_ids  # what min_tokens holds back, with each request's stop ids

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        steps: list[int],
        histories: Callable[[], tuple[list, list]] | None = None,
    ) -> SamplerOutput:
        """logits: [N, V] fp32, one row per sequence that samples this step; steps[i]: how many
        tokens row i has generated before this one; histories() -> (each row's prompt ids, its
        output before the row's token), asked for where a row's params penalize. Logprobs are those
        of the logits given (a structured output's mask applied), before penalties: vLLM's raw logprobs."""
        raw = logits
        if any(p.penalized for p in params):
            prompts, pasts = histories()
            logits = apply_penalties(logits.clone(), params, prompts, pasts, self.eos_token_ids)
        greedy = all(p.greedy for p in params)
        if greedy:
            token_ids = logits.max(dim=-1).indices  # first maximum, as argmax; 2-3x faster on CPU
        else:
            token_ids = self._sample(logits, params, steps)
        want = [p.logprobs is not None or p.num_samples > p.n for p in params]  # best_of ranks by logprob
        token_list = token_ids.tolist()
        if not any(want):
            return SamplerOutput(token_list, [None] * len(params))
        return SamplerOutput(token_list, self._logprobs(raw, token_ids, params, want))

    def _sample(self, logits, params, steps) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        scaled = logits / temperature[:, None]
        if any(p.min_p for p in params):  # after the temperature, before top-k and top-p (as vLLM)
            min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)[:, None]
            probs = scaled.softmax(dim=-1)
            scaled = scaled.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        if all(p.seed is None for p in params):
            noise.exponential_(generator=self.generator)
        else:
            for i, (p, step) in enumerate(zip(params, steps)):
                if p.seed is None:
                    noise[i].exponential_(generator=self.generator)
                else:
                    self.scratch.manual_seed((p.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
                    noise[i].exponential_(generator=self.scratch)
        sampled = (probs / noise).argmax(dim=-1)
        greedy_rows = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(greedy_rows, logits.argmax(dim=-1), sampled)

    @staticmethod
    def _logprobs(logits, token_ids, params, want) -> list[dict[int, float] | None]:
        rows = [i for i, w in enumerate(want) if w]
        # the distribution sampled from before penalties (a grammar's mask included, as vLLM's); a
        # masked token's -inf clamped as vLLM does, for JSON
        logprobs = torch.log_softmax(logits[rows], dim=-1).clamp(min=MASKED_LOGPROB)
        n = max(params[i].logprobs or 0 for i in rows)
        top = _top(logprobs, max(n, 1))
        chosen = logprobs.gather(1, token_ids[rows][:, None]).squeeze(1).tolist()
        out: list[dict[int, float] | None] = [None] * len(params)
        for j, i in enumerate(rows):
            k = params[i].logprobs or 0
            entry = dict(zip(top[j][0][:k], top[j][1][:k]))
            entry[int(token_ids[i])] = chosen[j]
            out[i] = entry
        return out


def _top(logprobs: torch.Tensor, n: int) -> list[tuple[list[int], list[float]]]:
    """Per row, the n largest (ids, values), ties to the lower id: topk alone picks among tied
    values by its own blocking, which moves with the batch."""
    kth = logprobs.topk(n, dim=-1).values[:, -1]
    top = []
    for row, least in zip(logprobs, kth):
        ids = (row >= least).nonzero().squeeze(1)  # ascending
        values, order = row[ids].sort(descending=True, stable=True)
        top.append((ids[order[:n]].tolist(), values[:n].tolist()))
    return top
