"""What a request's parameters do to its logit rows before the draw, as vLLM does them, in its order:
bad words banned, EOS and stop ids banned before min_tokens, logit_bias added, then the
repetition penalty (over prompt and output), the frequency penalty (times each token's count in
the output) and the presence penalty (once per token the output holds).

Each row is one next token of one sequence: `past` holds the output before it (with a
verification's drafts before its position), so a row's result depends on its own request alone
(batch-invariant, and the same on whichever node samples it). Rows are batched: one scatter
counts every penalized row's history, one index_put adds every bias, and the penalties touch
only the (row, token) pairs the histories hold.
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
    # Only the tokens a row's history holds change: those (row, token) pairs are gathered, penalized
    # and written back (the same arithmetic, element by element, as on the whole [R, V] rows, at a
    # cost of the histories' length rather than the vocabulary's).
    repeating = any(params[i].repetition_penalty != 1 for i in rows)
    where, counts = _history_counts([pasts[i] for i in rows], [prompts[i] for i in rows] if repeating else None, vocab)
    if where.numel() == 0:
        return logits
    row, token = where // vocab, where % vocab
    at = (torch.tensor(rows)[row].to(dev), token.to(dev))
    counts = counts.to(dev)
    values = logits[at]
    if repeating:  # every gathered token is in the prompt or the output
        penalty = torch.tensor([params[i].repetition_penalty for i in rows], device=dev)[row.to(dev)]
        values = torch.where(values > 0, values / penalty, values * penalty)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=dev)[row.to(dev)]
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=dev)[row.to(dev)]
    logits[at] = values - frequency * counts - presence * (counts > 0)
    return logits


def _history_counts(outputs: list[list[int]], prompts: list[list[int]] | None, vocab: int):
    """(keys, counts): each (row, token) pair of the rows' outputs (and prompts, when given) as
    row * vocab + token, sorted, with how often the token is in that row's output (0 for a token
    only in the prompt). Ids past the vocabulary are ignored."""

    def keys(histories: list[list[int]]) -> torch.Tensor:
        flat = torch.tensor([t for h in histories for t in h], dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(len(histories)), torch.tensor([len(h) for h in histories]))
        inside = flat < vocab
        return row[inside] * vocab + flat[inside]

    seen, counts = torch.unique(keys(outputs), return_counts=True)
    if prompts is None:
        return seen, counts.float()
    both = torch.unique(torch.cat([seen, keys(prompts)]))
    all_counts = torch.zeros(len(both))
    all_counts[torch.searchsorted(both, seen)] = counts.float()
    return both, all_counts
