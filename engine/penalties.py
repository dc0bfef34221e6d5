"""What a request's parameters do to its logit rows before the draw, as vLLM does them, in its order:
bad words banned, EOS and stop ids banned before min_tokens, logit_bias added, then the
repetition penalty (over prompt and output), the frequency penalty (times each token's count in
the output) and the presence penalty (once per token the output holds).

Each row is one next token of one sequence: `past` holds the output before it (with a
verification's drafts before its position), so a row's result depends on its own request alone
(batch-invariant, and the same on whichever node samples it). Rows are batched: one scatter
builds the counts of every penalized row, one index_put adds every bias.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[list[int]],
    pasts: Sequence[list[int]],
    eos_token_ids: tuple[int, ...],
) -> torch.Tensor:
    """logits [N, V] fp32 (modified in place and returned); per row its params, its prompt's ids
    and its output before the row's token."""
    vocab, dev = logits.shape[1], logits.device
    banned_rows, banned_ids = [], []
    for i, (p, past) in enumerate(zip(params, pasts)):
        for word in p.bad_words_token_ids:  # a word's last token, where the output ends with the rest
            if len(word) == 1 or (len(past) >= len(word) - 1 and past[len(past) - len(word) + 1 :] == list(word[:-1])):
                banned_rows.append(i)
                banned_ids.append(word[-1])
        if len(past) < p.min_tokens:
            ends = [t for t in ((() if p.ignore_eos else eos_token_ids) + p.stop_token_ids) if t < vocab]
            banned_rows += [i] * len(ends)
            banned_ids += ends
    if banned_rows:
        logits[torch.tensor(banned_rows, device=dev), torch.tensor(banned_ids, device=dev)] = float("-inf")
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if biased:
        rows, ids, values = zip(*biased)
        index = (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev))
        logits.index_put_(index, torch.tensor(values, device=dev, dtype=logits.dtype), accumulate=True)
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty]
    if not rows:
        return logits
    sub = logits[rows]
    counts = _counts([pasts[i] for i in rows], vocab).to(dev)
    repetition = torch.tensor([params[i].repetition_penalty for i in rows], device=dev)[:, None]
    if (repetition != 1).any():
        seen = (counts > 0) | (_counts([prompts[i] for i in rows], vocab).to(dev) > 0)
        penalty = torch.where(seen, repetition, torch.ones_like(repetition))
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=dev)[:, None]
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=dev)[:, None]
    sub = sub - frequency * counts - presence * (counts > 0)
    logits[rows] = sub
    return logits


def _counts(histories: list[list[int]], vocab: int) -> torch.Tensor:
    """[R, V] fp32: how often each token occurs in each history (ids past the vocabulary ignored)."""
    width = max((len(h) for h in histories), default=0)
    ids = torch.full((len(histories), width), vocab, dtype=torch.long)  # vocab: a padding column
    for r, h in enumerate(histories):
        ids[r, : len(h)] = torch.tensor(h, dtype=torch.long).clamp(max=vocab)
    counts = torch.zeros(len(histories), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float))
    return counts[:, :vocab]
